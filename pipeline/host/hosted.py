"""A pipeline whose kernels run in a kernel host: what `open_pipeline` returns for a binding
manifest, in a production run and in a gate alike.

The bundle's facts (family, tokenizer, sequence length) are read here; every network run goes to
the host, which loaded the kernels. Slot calls the host's audit drew come back whole with each
answer and are computed again here by the native region they replaced (`judge_call`), a process
that never loaded the kernel's library; a call that differs is logged with its slot, and
counted (`HostedPipeline.audited`). For a gate, `regions` gives each slot's native region,
lowered here, with a kernel that runs one call in the host on this side's buffers.
"""
from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

import torch

from pipeline.bundle.reader import Bundle
from pipeline.dtypes import TOLERANCE
from pipeline.files import read_regular
from pipeline.graph.abi import SlotLayout
from pipeline.host.client import Audited, HostedKernel, HostSpec, start
from pipeline.isolation import KernelAborted, Limits
from pipeline.kernels.bind import MAX_LIBRARY_BYTES
from pipeline.kernels.manifest import load_manifest
from pipeline.log import get as log_topic
from pipeline.modes import Mode
from pipeline.runtime.pipeline import BundleFacts, open_pipeline, open_regions, resolve_device
from pipeline.runtime.remote import KernelInHost, KernelsInHost

log = log_topic("host")


def judge_call(region, kept: dict) -> dict:
    """One drawn call computed again by `region.native` on the inputs it was given: the
    shadow's figures (runtime/shadow.py `_row`), whether they pass, and whether the host's own row
    for the call (a gate's shadow) says the same."""
    from pipeline.runtime.shadow import _row
    inputs, out = [x.to(region.native.device) for x in kept["inputs"]], kept["output"]
    atol, rtol = TOLERANCE.get(region.abi["outputs"][0]["dtype"], (0.0, 0.0))
    (expected,) = region.native.step([x.clone() for x in inputs])
    row = [float(v) for v in _row(0, out.to(expected.device), expected, inputs, inputs, atol,
                                  rtol).tolist()]
    figures = {"slot": kept["key"], "call": kept["call"], "max_error_ratio": row[1],
               "max_abs_diff": row[2], "non_finite": int(row[3]),
               "passed": row[1] <= 1.0 and not row[3]}
    host = kept.get("row")
    figures["host_agrees"] = host is None or all(
        _same(a, b) for a, b in zip(row[1:4], [float(v) for v in host.reshape(-1).tolist()][1:4]))
    return figures


def _same(a: float, b: float) -> bool:
    """Two figures of one call, computed in two processes: equal up to rounding, or both the
    same non-finite value."""
    return a == b or (a != a and b != b) or abs(a - b) <= 1e-5 * max(1.0, abs(a))


def library_digests(manifest: Path) -> dict[str, tuple[Path, str]]:
    """binding id -> (library, sha256 of its bytes as read here)."""
    out = {}
    for b in load_manifest(manifest).bindings:
        data = read_regular(b.library, MAX_LIBRARY_BYTES, "pipeline.kernels.bind.MAX_LIBRARY_BYTES")
        out[b.id] = (Path(b.library), hashlib.sha256(data).hexdigest())
    return out


class RemoteKernel(KernelInHost):
    """A slot's kernel called in the host on this side's buffers: the output and the workspace
    come back as the kernel left them, and each input it changed (a probe's call)."""

    def __init__(self, pipeline: HostedPipeline, key: str, abi: Mapping):
        self.pipeline, self.key, self.layout = pipeline, key, SlotLayout.of(abi)

    def __call__(self, *args):
        layout = self.layout
        inputs, ws, out = list(layout.inputs(args)), layout.workspace(args), layout.output(args)
        got = self.pipeline.ask("call", key=self.key, inputs=inputs, workspace=ws, out=out)
        written = got["inputs"]
        if not isinstance(written, list) or len(written) != len(inputs):
            raise self.pipeline.host.broken(f"a call's answer with {str(written)[:40]} for its "
                                            f"{len(inputs)} inputs")
        for mine, theirs in ((out, got["out"]), *((m, t) for m, t in zip(inputs, written)
                                                  if t is not None),
                             *(((ws, got["workspace"]),) if ws is not None else ())):
            mine.copy_(theirs.to(mine.device).view(mine.dtype).reshape(mine.shape))

    def cuda_outputs(self, inputs: list[torch.Tensor]) -> dict:
        return self.pipeline.ask("cuda_checks", key=self.key, inputs=inputs)


class HostedPipeline(BundleFacts, KernelsInHost):
    """A bundle's pipeline with its kernels in a kernel host (`HostSpec`); close it (or use it as
    a context manager) to end the host."""

    def __init__(self, spec: HostSpec, *, what: str = "kernel host", limits: Limits = Limits()):
        self.bundle = Bundle.open(spec.bundle)
        self.device = resolve_device(spec.device)
        self.mode = Mode.of(spec.mode, self.device.type)
        self.spec = spec
        self.digests = library_digests(spec.bindings) if spec.bindings else {}
        self.audited = Audited()
        self.host, ready = start(spec, [p for p, _ in self.digests.values()], what=what,
                                 limits=limits)
        self.confinement = ready["confinement"]
        kernels = {k["binding_id"]: HostedKernel(**k) for k in ready["kernels"]}
        for binding_id, (library, digest) in self.digests.items():
            got = kernels.get(binding_id)
            if got is None or got.library_sha256 != digest:
                self.close()
                raise KernelAborted(f"{what}: the host reports library "
                                    f"{None if got is None else got.library_sha256} for "
                                    f"'{binding_id}', but {library} holds {digest}",
                                    "channel", None, "opening")
            got.library = str(library)
        self.kernels = MappingProxyType(kernels)  # bound once, in the host: never rebound here

    # -- what runs in the host --------------------------------------------------------------
    def ask(self, kind: str, **body) -> dict:
        """One request; the audit's draws that come with the answer are judged here."""
        answer = self.host.request(kind, **body)
        self._judge(answer.get("audit") or {})
        return answer

    @property
    def encoder(self):
        hidden = self.family.io.hidden
        return lambda **inputs: {hidden: self.encode_many([inputs])[0]}

    def encode_many(self, inputs: list[dict]) -> list[torch.Tensor]:
        return self.ask("encoder", inputs=inputs)["outputs"]

    def generate(self, prompts: list[str], max_new_tokens: int, **sampling) -> list[dict]:
        self.require_decoder()
        return self.ask("generate", prompts=list(prompts), max_new_tokens=max_new_tokens,
                        sampling=sampling)["records"]

    def teacher_forced_logits(self, prompt_ids: list[int], token_ids: list[int]) -> list:
        return self.ask("forced", prompt_ids=list(prompt_ids), token_ids=list(token_ids))["logits"]

    def use_kernels(self, keys) -> None:
        self.ask("use_kernels", keys=list(keys))

    @property
    def shadow(self):
        """The host's shadow rows (`collect`), when it was opened with one."""
        return _HostShadow(self) if self.spec.shadow else None

    def tapped(self, replayed: dict) -> dict:
        """Every slot call's output, in order, of the kernels' eager run on `replayed`
        (families/workloads.py `run_replay`), as far as probe.DRIFT_BYTES allows."""
        from pipeline.gates.probe import DRIFT_BYTES
        return self.ask("tapped", replayed=replayed, max_bytes=DRIFT_BYTES)

    def time_region(self, key: str, **settings) -> dict:
        return self.ask("time_region", key=key, **settings)

    def cpu_seconds(self) -> float:
        return self.host.cpu_seconds()

    def call_limits(self):
        return self.host.watch.values

    # -- what runs here -------------------------------------------------------------------
    @functools.cached_property
    def _remote_kernels(self) -> dict[str, RemoteKernel]:
        """The host's kernels by binding id, each running one call there on this side's buffers."""
        remote: dict[str, RemoteKernel] = {}
        for slot in self.bundle.slots:
            remote.setdefault(slot["binding_id"], RemoteKernel(self, slot["binding_id"], slot["abi"]))
        return remote

    @functools.cached_property
    def local(self):
        """The bundle opened here with every slot on its native region and the host's kernels
        behind `RemoteKernel`s: the native run of the probe's in-situ case (gates/probe.py). It
        runs in the eager mode only, so it is opened in that mode: lowered in the optimized one,
        it would make merged GEMM weights of its own (9 GB for Qwen3-8B) beside the model's."""
        return open_pipeline(self.bundle, device=str(self.device), checkpoint=self.spec.checkpoint,
                             mode=Mode.EAGER.value, kernels_in=(), kernels=self._remote_kernels,
                             in_process=True)

    @functools.cached_property
    def regions(self):
        """Each slot's native region, lowered here with only the weights it reads, and the
        host's kernel: what the draws, a probe and a region timing are judged by. The model
        itself is not loaded here for them, so a gate holds it once in each host only."""
        return open_regions(self.bundle, self._remote_kernels, device=str(self.device),
                            checkpoint=self.spec.checkpoint, mode=self.mode.value)

    def _judge(self, audit: dict) -> None:
        a = self.audited
        first = a.calls  # the answer counts its calls from 0: ours count from the pipeline's first
        a.calls += audit.get("calls", 0)
        a.drawn += audit.get("drawn", 0)
        a.over_budget += audit.get("over_budget", 0)
        for kept in audit.get("kept", []):
            region = self.regions.get(kept["key"])
            if region is None:
                continue
            figures = judge_call(region, {**kept, "call": first + kept["call"]})
            a.judged.append(figures)
            if not figures["passed"] or not figures["host_agrees"]:
                log.warning("audit: call %d of slot %s differs from its native region (error "
                            "ratio %.3g%s)", figures["call"], figures["slot"],
                            figures["max_error_ratio"],
                            "" if figures["host_agrees"] else "; the host's figures disagree")

    def close(self) -> None:
        self.host.close()


class _HostShadow:
    def __init__(self, pipeline: HostedPipeline):
        self.pipeline = pipeline

    def collect(self) -> list[dict]:
        from pipeline.runtime.shadow import calls_of
        got = self.pipeline.ask("collect")
        return calls_of(got["rows"], got["sites"], int(got["count"]))
