"""safetensors files with a CRC-32 of every tensor in their metadata (``"attnlab.crc32"``).

:func:`write_tensors` records the checksums; :func:`read_tensors` reads every tensor and
verifies them, raising :class:`~attnlab.models.checkpoint.CheckpointError` naming the
file (unreadable, truncated) or the tensor (checksum).  A file without the metadata
(written by another tool) is read without checksums.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch

from attnlab.models.checkpoint import CheckpointError

__all__ = ["CRC_KEY", "safetensors_module", "crc32", "write_tensors", "read_tensors"]

CRC_KEY = "attnlab.crc32"


def safetensors_module():
    try:
        import safetensors.torch as st
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("attnlab.train.checkpoint needs the 'safetensors' package: pip install safetensors") from e
    return st


def crc32(t: torch.Tensor) -> int:
    b = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return zlib.crc32(b.numpy().data) if b.numel() else 0


def write_tensors(st, path: Path, tensors: dict[str, torch.Tensor], metadata: dict | None = None) -> None:
    """Save ``tensors`` (contiguous CPU copies where storages are shared) with checksums."""
    ptrs: dict[int, int] = {}
    for t in tensors.values():
        p = t.untyped_storage().data_ptr()
        ptrs[p] = ptrs.get(p, 0) + 1
    out = {}
    for name, t in tensors.items():
        t = t.detach().cpu()
        if ptrs[t.untyped_storage().data_ptr()] > 1 or not t.is_contiguous():
            t = t.clone(memory_format=torch.contiguous_format)  # safetensors refuses shared storage
        out[name] = t
    meta = dict(metadata or {})
    meta["format"] = "pt"
    meta[CRC_KEY] = json.dumps({n: crc32(t) for n, t in out.items()}, sort_keys=True)
    st.save_file(out, str(path), metadata=meta)


def read_tensors(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """All tensors and the metadata of one file; checksums verified.  Errors name the file
    (unreadable) or the tensor (checksum)."""
    from safetensors import safe_open

    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            names = list(f.keys())
            tensors = {}
            for n in names:
                try:
                    tensors[n] = f.get_tensor(n)
                except Exception as e:  # noqa: BLE001 - safetensors raises several kinds
                    raise CheckpointError(f"{path}: tensor {n!r} cannot be read ({e})") from None
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - SafetensorError, OSError, ...
        size = path.stat().st_size
        raise CheckpointError(
            f"{path} ({size} bytes): not a readable safetensors file, corrupt or truncated? ({type(e).__name__}: {e})"
        ) from None
    crcs = meta.get(CRC_KEY)
    if crcs is not None:
        try:
            crcs = json.loads(crcs)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path}: metadata {CRC_KEY!r} is not valid JSON ({e})") from None
        for n, t in tensors.items():
            if n in crcs and crc32(t) != crcs[n]:
                raise CheckpointError(f"{path}: tensor {n!r} fails its CRC-32 check (the file is corrupted)")
    return tensors, meta
