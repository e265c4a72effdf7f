"""Cutting a config level's layer count: one layer of each kind its per-layer lists name, and every
per-layer list, schedule and layer index cut to match. Pure dict work, called by
``configs.shrink_config_dict`` for every config level."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pytest_modelpatch.families.shrink.sizes import HEAD_KEYS, KV_HEAD_KEYS, LAYER_KEYS, TINY_LAYERS, is_int, shrink_int


def shrink_layers(before: dict[str, Any], out: dict[str, Any]) -> None:
    """Cut the layer count; keep one layer of each kind named in per-layer lists."""
    stages = before.get("depths")
    counts = {
        k: v
        for k, v in before.items()
        if k in LAYER_KEYS
        and is_int(v)
        and v > TINY_LAYERS
        # a hierarchical backbone's stage count: detection heads expect every level
        and not (isinstance(stages, (list, tuple)) and v == len(stages))
    }
    if not counts:
        return
    old = max(counts.values())
    per_layer = {k: v for k, v in before.items() if isinstance(v, (list, tuple)) and len(v) == old and old > 1}
    keep = _layers_to_keep(per_layer, old)
    keep = _cover_block_pattern(before, old, keep)
    for key, value in counts.items():
        out[key] = len(keep) if value == old else TINY_LAYERS
    for key, entries in per_layer.items():
        shrunk = out.get(key)  # already shrunk per entry (heads per stage), when it could be
        source = shrunk if isinstance(shrunk, list) and len(shrunk) == len(entries) else entries
        out[key] = [source[i] for i in keep]
    n = len(keep)
    if isinstance(before.get("stage_names"), list) and len(before["stage_names"]) == old + 1:
        # backbones: "stem" plus a name per stage; keep as many of the last stages as
        # were wanted (detection heads read several feature levels).
        names = out["stage_names"] = before["stage_names"][: n + 1]
        wanted = len(before.get("out_indices") or before.get("out_features") or [None])
        out["out_indices"] = list(range(n + 1 - min(wanted, n), n + 1))
        out["out_features"] = [names[i] for i in out["out_indices"]]
    elif "stage_names" in before:
        out["out_features"] = out["out_indices"] = None  # let the default (last stage) apply
    if isinstance(before.get("per_layer_config"), dict):
        out["per_layer_config"] = _keep_layer_entries(before["per_layer_config"], keep)
    for key in ("first_k_dense_replace", "max_window_layers"):
        if is_int(before.get(key)):
            out[key] = min(before[key], 1 if key == "first_k_dense_replace" else n)
    if is_int(before.get("decoder_sparse_step")) and before["decoder_sparse_step"] > n:
        out["decoder_sparse_step"] = 1
    for key, value in before.items():
        # Jamba-style schedules: layer i is special when i % period == offset
        if is_int(value) and str(key).endswith("_layer_period"):
            out[key] = min(value, n)
        elif is_int(value) and str(key).endswith("_layer_offset"):
            out[key] = min(value, n - 1)
        elif is_int(value) and str(key).endswith(("_layer_id", "_layer_idx")) and 0 <= value < old:
            out[key] = value * n // old  # MiniCPM-V's merger insert point: still inside the stack
    for key, value in before.items():
        # lists of layer indices (mlp_only_layers, global_attn_indexes, ...): scale into range
        if str(key).endswith(("_layers", "_indexes")) and isinstance(value, list) and key not in per_layer:
            if all(is_int(i) and 0 <= i < old for i in value):
                out[key] = sorted({i * n // old for i in value})


def shrink_uncounted_layer_list(before: dict[str, Any], out: dict[str, Any]) -> None:
    """A per-layer type list that is the only record of the depth (Nemotron-H's
    ``layers_block_type``, 52 long inside NeMo SpeechLM): keep the first layer of each kind."""
    if any(is_int(before.get(k)) for k in LAYER_KEYS):
        return
    for key in ("layers_block_type", "layer_types", "block_types"):
        value = before.get(key)
        if isinstance(value, list) and len(value) > TINY_LAYERS:
            out[key] = [value[i] for i in _layers_to_keep({key: value}, len(value))]


def _cover_block_pattern(before: dict[str, Any], old: int, keep: list[int]) -> list[int]:
    """Keep enough layers to reach every kind of a repeating block pattern (RecurrentGemma)."""
    for key, value in before.items():
        if str(key).endswith("block_types") and isinstance(value, list) and 0 < len(value) < old:
            wanted = min(len(value), 4)
            keep = sorted(set(keep) | set(range(wanted)))[: max(wanted, len(keep))]
    return keep


def _keep_layer_entries(per_layer: dict[str, Any], keep: list[int]) -> dict[str, Any]:
    """``per_layer_config`` entries of the kept layers, renumbered ("05" -> "1")."""
    kept: dict[str, Any] = {}
    for key, value in per_layer.items():
        if str(key).isdigit() and int(key) in keep:
            kept[str(keep.index(int(key)))] = _shrink_layer_entry(value) if isinstance(value, dict) else value
    return kept


def _shrink_layer_entry(entry: dict[str, Any]) -> dict[str, Any]:
    """One layer's overrides (Dots3's wider indexed layers) shrunk like the config; kv heads
    that equalled the heads still do."""
    out = {k: shrink_int(k, v) if is_int(v) else v for k, v in entry.items()}
    heads = next((k for k in HEAD_KEYS if is_int(entry.get(k))), None)
    for kv in KV_HEAD_KEYS:
        if heads is not None and is_int(entry.get(kv)) and entry[kv] >= entry[heads]:
            out[kv] = out[heads]
    return out


def resize_per_layer_lists(shrunk: dict[str, Any], overrides: dict[str, Any]) -> None:
    """An overridden layer count resizes the per-layer lists it did not override, cyclically."""
    for key in LAYER_KEYS:
        old, new = shrunk.get(key), overrides.get(key)
        if not (is_int(old) and is_int(new)) or old == new:
            continue
        for name, value in shrunk.items():
            if isinstance(value, list) and len(value) == old and old > 1 and name not in overrides:
                shrunk[name] = [value[i % old] for i in range(new)]


def _layers_to_keep(per_layer: Mapping[str, Sequence[Any]], old: int) -> list[int]:
    """Indices of the layers to keep: the first of each kind, then the earliest others."""
    keep: list[int] = []
    # layer_types decides first; other kind lists (Kimi's mlp_layer_types) add their kinds
    ordered = sorted(per_layer, key=lambda k: k != "layer_types")
    for position, key in enumerate(ordered):
        if position and not str(key).endswith(("layer_types", "block_type", "block_types")):
            continue
        seen: list[Any] = []
        for index, value in enumerate(per_layer[key]):
            if value not in seen and len(keep) < 4:
                seen.append(value)
                if index not in keep:
                    keep.append(index)
    for index in range(old):
        if len(keep) >= TINY_LAYERS:
            break
        if index not in keep:
            keep.append(index)
    return sorted(keep)
