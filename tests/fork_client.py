"""``python -m pytest ARGS``, run by the warm fork server (``fork_server.py``) of this test session.

pytester runs this in place of ``python -m pytest``: it hands the server its arguments, working
directory, environment and standard streams, and exits with the status of the forked run.
"""

import os
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fork_server import receive_message, send_message

connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
connection.connect(os.environ["MODELPATCH_FORK_SERVER"])
send_message(connection, {"args": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ)}, fds=[0, 1, 2])
code, _ = receive_message(connection)
sys.exit(code)
