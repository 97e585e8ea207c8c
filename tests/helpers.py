"""Helpers shared by the test folders (importable as ``helpers``: ``tests/`` is on ``sys.path``
through ``tests/conftest.py``, in the pytest process and in every rank).

- ``close`` / ``mismatch``: the one comparison of the tests, ``torch.testing.assert_close`` at a
  tolerance derived from the dtype (``tolerance``), naming what differs;
- ``hf_model`` / ``read_all``: a transformers oracle model with redrawn weights; the tensors of
  a safetensors directory;
- ``tcp_sockets``: this process's TCP sockets ``(state, local ip, remote ip)``, from ``/proc``;
- ``on_ranks``: ``fn(rank, world, *args)`` on the session's warm ranks (the fmoe plugin's
  ``fmoe_pools``, handed over by ``tests/conftest.py``), or on fresh ones outside pytest.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

import torch


def tolerance(dtype: torch.dtype) -> float:
    """The relative tolerance of a comparison in ``dtype``: ~84 eps of it, never tighter than
    fp32's (exactly 1e-5 for fp32 and float64; ~0.65 for bf16, which a test then narrows)."""
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else 0.0
    return 1e-5 * max(1.0, eps / torch.finfo(torch.float32).eps)


def mismatch(a: torch.Tensor, b: torch.Tensor, what: str = "", rtol: Optional[float] = None,
             atol: float = 1e-6) -> Optional[str]:
    """Why ``a`` does not equal ``b`` within :func:`close`'s tolerance (None when it does): for
    tests that collect every failure before asserting."""
    try:
        close(a, b, what, rtol=rtol, atol=atol)
    except AssertionError as e:
        return str(e)
    return None


def close(a: torch.Tensor, b: torch.Tensor, what: str = "", rtol: Optional[float] = None,
          atol: float = 1e-6) -> None:
    """``a`` equals ``b`` elementwise at ``rtol`` (default :func:`tolerance` of ``b``'s dtype:
    1e-5 in fp32), shapes included. The atol only covers elements that cancel to ~0: the larger
    of ``atol`` times the tensor's scale (at least 1) and ~84 eps of ``b``'s dtype times its scale
    (its largest element): 1e-5 of the scale in fp32. The one comparison of the tests.

    Why ~84 eps of the scale: an element that cancels carries the rounding of the terms it summed,
    not of its own size. Two fp32 implementations with different reduction orders, through a few
    layers of width 64, differ by up to 2.8e-6 of a gradient's largest element (measured on
    transformers' DeepSeek-V3 gradients, AMD EPYC; ~24 fp32 eps): 1e-5 (~84 eps) leaves a 3x margin
    and still fails any scale bug (a gradient x2 is off by 100% of its scale)."""
    rtol = tolerance(b.dtype) if rtol is None else rtol
    scale = b.abs().max().item() if b.numel() else 0.0
    eps = torch.finfo(b.dtype).eps if b.dtype.is_floating_point else 0.0
    cancel = 1e-5 * scale * eps / torch.finfo(torch.float32).eps        # exactly 1e-5 of it in fp32
    torch.testing.assert_close(a, b, rtol=rtol, atol=max(atol * max(1.0, scale), cancel),
                               msg=lambda m: f"{what}: {m} (scale {scale:.3g})")


def hf_model(cfg, cls_name: str, seed: int = 0):
    """A transformers model built from ``cfg.to_hf()``, with weights (and persistent float buffers,
    e.g. DeepSeek-V3's expert bias) redrawn at a larger scale: the conformance suite's own model."""
    from fmoe.testing.conformance import _hf_model

    return _hf_model(cls_name, cfg, seed)


def read_all(path: str) -> dict:
    """Every tensor of the ``.safetensors`` files in directory ``path``, by key."""
    from safetensors import safe_open

    out = {}
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), "pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


class _Session:
    pools: Any = None          # the plugin's Pools, set by tests/conftest.py for the session


def use_pools(pools: Any) -> None:
    """Route :func:`on_ranks` to ``pools`` (``None``: fresh ranks per call)."""
    _Session.pools = pools


def on_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 120.0, **kw: Any) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` gloo ranks: warm ones in a pytest session."""
    if _Session.pools is None:
        from fmoe.testing import spawn

        return spawn(fn, world, *args, timeout=timeout, **kw)
    return _Session.pools.run(fn, world, *args, timeout=timeout, **kw)


def program(main: Callable[[list], int], capture: Any, *args: str) -> Any:
    """A program's ``main(args)`` in this process (its parser, exit codes, one-line errors; tests
    of the process boundary start it as a process instead): ``returncode``, ``stdout``, ``stderr``
    as ``capture`` (pytest's ``capsys``, or ``capfd`` where spawned ranks write to this process's
    file descriptors) read them."""
    import types

    capture.readouterr()
    try:
        code = main(list(args))
    except SystemExit as e:                         # a usage error
        code = e.code
    out = capture.readouterr()
    return types.SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)


def _ip(hex_addr: str) -> str:
    import ipaddress

    addr = bytes.fromhex(hex_addr.split(":")[0])
    words = [addr[i:i + 4][::-1] for i in range(0, len(addr), 4)]     # /proc prints host-order words
    ip = ipaddress.ip_address(b"".join(words))
    return str(ip.ipv4_mapped or ip) if ip.version == 6 else str(ip)


def tcp_sockets() -> list[tuple[str, str, str]]:
    """``(state, local ip, remote ip)`` of this process's TCP sockets (Linux ``/proc``; state
    ``"0A"`` is LISTEN, whose remote is the wildcard)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/self/net/{table}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[9] in inodes:
                    found.append((cols[3], _ip(cols[1]), _ip(cols[2])))
    return found
