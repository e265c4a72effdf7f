"""Helpers the plugin's own tests share; fixtures stay in tests/conftest.py, where pytest finds them."""
