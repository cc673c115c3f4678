"""`trtmc kernel export flashinfer-decode-attention`: FlashInfer's batch decode kernel, built from
a pinned, unmodified FlashInfer release's headers into a TVM-FFI DSO with the decode-attention
recipe's ABI (`flashinfer_decode_attention.cu` says how the cache and the device-side length
reach FlashInfer's kernel).

The headers come from an installed `flashinfer-python` wheel, found without importing it (its
import starts torch and its JIT), or from a folder laid out like that package (`--flashinfer`):
its `_build_meta.py` names the version, which must be the pin, and `data/include` and
`data/cccl` hold the headers. The version, its commit, the headers' digest, the arch and every
flag go into the DSO's `.trtmc_build` section, which `trtmc kernel inspect` shows and a
promotion receipt records."""
from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.errors import UserError
from pipeline.files import read_regular, sha256_file, shown
from pipeline.graph.select import load_selection, receipts_of
from pipeline.kernels.build import arch_list, build_kernel, cuda_gpu_present, nvcc_version

PINNED_VERSION = "0.7.2.post1"
SOURCE = Path(__file__).with_name("flashinfer_decode_attention.cu")
HEAD_DIM = 128
GROUP_SIZES = (1, 2, 4, 8)
DTYPES = ("BF16", "FP16")
# FlashInfer's own JIT flags for its attention modules (flashinfer/jit/core.py, cpp_ext.py), less
# the FP8 switches this kernel does not use
FLAGS = ("-O3", "-use_fast_math", "--expt-relaxed-constexpr", "-DFLASHINFER_ENABLE_F16",
         "-DFLASHINFER_ENABLE_BF16", "-static-global-template-stub=false")
# header trees of the package, in FlashInfer's include order (its vendored CCCL first)
HEADER_TREES = ("data/cccl/cub", "data/cccl/libcudacxx/include", "data/cccl/thrust", "data/include")
MAX_BUILD_META_BYTES = 4096
MIN_SM_MAJOR = 8  # FlashInfer's decode kernel: Ampere and newer (SM 8.x, 9.0, 10.x, 12.x)


@dataclass(frozen=True)
class FlashInferRelease:
    """A FlashInfer package's headers, as found on disk."""
    root: Path
    version: str
    commit: str | None

    def include_dirs(self) -> list[Path]:
        return [self.root / t for t in HEADER_TREES]

    def headers_sha256(self) -> str:
        """One digest over every file of the header trees (relative path and bytes), so the
        receipt names the exact headers, not only the version they claim."""
        digest = hashlib.sha256()
        for tree in self.include_dirs():
            for path in sorted(p for p in tree.rglob("*") if p.is_file() and not p.is_symlink()):
                digest.update(str(path.relative_to(self.root)).encode() + b"\0")
                digest.update(bytes.fromhex(sha256_file(path)))
        return digest.hexdigest()


def find_release(folder: Path | None, version: str) -> FlashInferRelease:
    """The FlashInfer at `folder` (a copy of the package's folder), else the installed one;
    refused unless it is `version` and holds its header trees."""
    if folder is None:
        spec = importlib.util.find_spec("flashinfer")
        if spec is None or spec.origin is None:
            raise UserError(f"FlashInfer is not installed: pip install --no-deps "
                            f"flashinfer-python=={version} (only its headers are used), or pass "
                            f"--flashinfer FOLDER", param="flashinfer")
        folder = Path(spec.origin).parent
    meta = folder / "_build_meta.py"
    try:
        text = read_regular(meta, MAX_BUILD_META_BYTES, "pipeline.kernels.flashinfer."
                            "MAX_BUILD_META_BYTES").decode("utf-8", "replace")
    except (OSError, UserError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise UserError(f"{shown(meta)}: cannot read FlashInfer's build metadata ({why}); "
                        f"expected the flashinfer package folder", param="flashinfer") from None
    found = re.search(r'^__version__\s*=\s*"([^"\n]{1,64})"', text, re.M)
    commit = re.search(r'^__git_commit__\s*=\s*"([0-9a-f]{7,40})"', text, re.M)
    if found is None:
        raise UserError(f"{shown(meta)}: no __version__ = \"...\" line", param="flashinfer")
    if found.group(1) != version:
        raise UserError(f"{shown(folder)}: FlashInfer {found.group(1)}, but the pin is {version} "
                        f"(pass --flashinfer-version {found.group(1)} to build against it)",
                        param="flashinfer")
    release = FlashInferRelease(folder, version, commit and commit.group(1))
    for tree in release.include_dirs():
        if not tree.is_dir():
            raise UserError(f"{shown(tree)}: missing; FlashInfer's headers are expected there",
                            param="flashinfer")
    return release


def check_selection(path: Path) -> dict[str, Any]:
    """The ABI of the selection at `path` when this kernel implements it; else one line naming
    the argument that differs and what it expected."""
    abi = receipts_of(load_selection(path))[0].abi.to_json()  # the ABI as a kernel's files hold it
    where = shown(path)
    names = ("q", "k_cache", "v_cache", "kv_len")
    if len(abi["inputs"]) != 4 or len(abi["outputs"]) != 1 or abi["extra_args"]:
        raise UserError(f"{where}: {len(abi['inputs'])} inputs, {len(abi['outputs'])} outputs and "
                        f"{len(abi['extra_args'])} extra args; FlashInfer decode attention takes "
                        f"(q, k_cache, v_cache, kv_len) -> out")
    if abi["workspace_bytes"]:
        raise UserError(f"{where}: workspace_bytes {abi['workspace_bytes']}; this kernel keeps its "
                        f"plan and partials in its own device buffers (select the recipe's region "
                        f"without a workspace)")
    q, k, v, kv_len = abi["inputs"]
    out = abi["outputs"][0]

    def refuse(name: str, t: dict[str, Any], expected: str) -> UserError:
        return UserError(f"{where}: {name} is {t['dtype']} {t['shape']}, expected {expected}")

    if q["dtype"] not in DTYPES or len(q["shape"]) != 4 or q["shape"][0] != 1 or \
            q["shape"][2] not in (1, -1) or q["shape"][3] != HEAD_DIM:
        raise refuse("q", q, f"BF16 or FP16 [1, Hq, 1 or -1, {HEAD_DIM}]")
    heads = q["shape"][1]
    for name, t in zip(names[1:3], (k, v)):
        if t["dtype"] != q["dtype"] or len(t["shape"]) != 4 or t["shape"][0] != 1 or \
                t["shape"][3] != HEAD_DIM or t["shape"][1] <= 0 or t["shape"][2] <= 0 or \
                heads % t["shape"][1] or heads // t["shape"][1] not in GROUP_SIZES:
            raise refuse(name, t, f"{q['dtype']} [1, Hkv, C, {HEAD_DIM}] with Hq/Hkv one of "
                                  f"{', '.join(map(str, GROUP_SIZES))} (Hq = {heads})")
    if v["shape"] != k["shape"]:
        raise refuse("v_cache", v, f"like k_cache {k['shape']}")
    if (kv_len["dtype"], kv_len["shape"]) != ("INT32", [1]):
        raise refuse("kv_len", kv_len, "INT32 [1]")
    if (out["dtype"], out["shape"]) != (q["dtype"], q["shape"]):
        raise refuse("out", out, f"like q: {q['dtype']} {q['shape']}")
    return abi


def target_arch(arch: str | None) -> str:
    """The one architecture to build for: `arch`, else the visible GPU's; a machine without a
    GPU must be told (one line)."""
    if arch is None and not cuda_gpu_present():
        raise UserError("no CUDA GPU here: the FlashInfer exporter builds for the GPU it runs on, "
                        "or for --arch (90a: H100/H200; 100a: B200)", param="arch")
    arches = arch_list(arch)
    if len(arches) != 1:
        raise UserError(f"--arch {arch}: one architecture per DSO", param="arch")
    chosen = arches[0]
    if arch is None and chosen in ("90", "100", "101", "103", "110", "120", "121"):
        chosen += "a"  # the arch-specific target of a visible Hopper/Blackwell GPU
    if int(chosen.rstrip("af")) // 10 < MIN_SM_MAJOR:
        raise UserError(f"--arch {chosen}: FlashInfer's decode kernel needs SM {MIN_SM_MAJOR}.0 "
                        f"or newer", param="arch")
    return chosen


def _c_string(text: str) -> str:
    """`text` as a C string literal: every byte but plain ASCII as an octal escape."""
    plain = set(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 {}[]:,._-/+=@")
    return '"' + "".join(chr(b) if b in plain else f"\\{b:03o}" for b in text.encode()) + '"'


def export_decode_attention(output: Path, *, selection: Path | None = None, arch: str | None = None,
                            flashinfer: Path | None = None,
                            version: str = PINNED_VERSION) -> dict[str, Any]:
    """Build the DSO at `output`; returns the build information it carries."""

    if selection is not None:
        check_selection(selection)
    chosen = target_arch(arch)
    release = find_release(flashinfer, version)
    try:
        trtmc = importlib.metadata.version("trtmc")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        trtmc = None
    info = {"exporter": "flashinfer-decode-attention", "trtmc": trtmc,
            "flashinfer": {"version": release.version, "commit": release.commit,
                           "headers": str(release.root), "headers_sha256": release.headers_sha256()},
            "arch": f"sm_{chosen}", "nvcc": nvcc_version(), "flags": list(FLAGS)}
    with tempfile.TemporaryDirectory(prefix="trtmc-flashinfer-") as tmp:
        # the build information reaches the source through a header: a -D value would pass
        # through nvcc's own splitting of commas and backslashes
        header = Path(tmp) / "build_info.h"
        header.write_text(f"#define TRTMC_BUILD_INFO {_c_string(json.dumps(info, sort_keys=True))}\n")
        flags = [*FLAGS, *(f"-I{d}" for d in release.include_dirs()), "--pre-include", str(header)]
        build_kernel(SOURCE, output, cuda=True, cuda_arch=chosen, extra_flags=flags)
    return info
