"""The CLI a TensorRT and doit user expects: every flag's help with its default and
allowed values, an example per command, a wrong flag answered with that command's usage, errors
that name the flag the user typed, progress on stderr only (never mixed into data on stdout),
`--json` output, shell completion, and `embed --pooling mean --normalize`."""
from __future__ import annotations

import argparse
import contextlib
import functools
import io
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
import torch

from pipeline import cli, progress
from pipeline.bundle.reader import Bundle
from pipeline.families import registry

ROOT = Path(__file__).resolve().parent.parent


def trtmc(*argv) -> tuple[int, str, str]:
    """`trtmc ARGV` in this process -> (exit status, stdout, stderr); usable in any fixture."""
    out, err = io.TextIOWrapper(io.BytesIO(), encoding="utf-8"), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = cli.main([str(a) for a in argv])
        except SystemExit as e:  # argparse
            rc = e.code
    out.flush()
    return rc, out.buffer.getvalue().decode(), err.getvalue()


@pytest.fixture(autouse=True)
def _progress_default(monkeypatch):
    monkeypatch.delenv("TRTMC_PROGRESS", raising=False)
    yield
    progress.ask(None)


@pytest.fixture(scope="module")
def encoder(tiny_bert, tmp_path_factory):
    """Through the CLI, with --progress: native and slot-ready tiny-BERT bundles, the residual-add
    DSO and its manifest. Keeps each command's stdout and stderr."""
    work = tmp_path_factory.mktemp("cli")
    runs = {
        "build": trtmc("--progress", "build", tiny_bert, "--sequence-length", "32", "-o",
                       work / "native.bundle"),
        "inspect": trtmc("graph", "inspect", "--snapshot", work / "g.json", "--engine-role",
                         "DECODE", tiny_bert, "--sequence-length", "32", "--precision", "FP16"),
        "select": trtmc("graph", "select", work / "g.json", "--nodes",
                        "encoder.layers.0.attention_residual_add", "--binding-id", "res0",
                        "--workspace-bytes", "0", "-o", work / "res0.selection.json"),
        "kernel": trtmc("--progress", "kernel", "build", ROOT / "examples/byok/residual_add.cu",
                        "--cpu-only", "-o", work / "residual_add.so"),
    }
    runs["build_slot"] = trtmc("build", tiny_bert, "--sequence-length", "32", "--graph-patch",
                               work / "res0.selection.json", "-o", work / "slot.bundle")
    runs["manifest"] = trtmc("bind", "manifest", work / "res0.selection.json", "--library",
                             work / "residual_add.so", "-o", work / "bindings.json")
    for name, (rc, _, err) in runs.items():
        assert rc == 0, f"{name}: {err}"
    return {"work": work, "runs": runs, "native": work / "native.bundle",
            "slot": work / "slot.bundle", "bindings": work / "bindings.json"}


# -- help -------------------------------------------------------------------------------------
def _leaves(parser: argparse.ArgumentParser, path=()):
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
    for action in subs:
        for name, sub in action.choices.items():
            yield from _leaves(sub, path + (name,))


def test_every_command_has_an_example_and_every_flag_a_help_line():
    leaves = list(_leaves(cli.parser()))
    assert len(leaves) >= 13
    for path, p in leaves:
        command = "trtmc " + " ".join(path)
        assert p.epilog and p.epilog.startswith("example:\n") and command in p.epilog, command
        for action in p._actions:
            assert action.help, f"{command} {action.option_strings or action.dest}: no help"
        text = p.format_help()
        assert "example:\n  " in text, command  # examples keep their lines


def test_help_shows_defaults_and_allowed_values():
    def help_of(*path):
        p = cli.parser()
        for name in path:
            p = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
        return " ".join(p.format_help().split())

    run = help_of("run")
    assert "sampling temperature, in (0, 10000] (default: 1.0)" in run and "sampling seed (default: 0)" in run
    assert "--device DEVICE cpu, cuda, cuda:N or auto (default: auto" in run
    assert "--pooling {mean} mean: average over the real tokens only" in help_of("embed")
    assert "(one of: bash, zsh)" in help_of("completion")
    inspect = help_of("graph", "inspect")
    for family in registry():  # roles and precisions come from the family contracts
        default = family.default_options["precision"]
        assert f"{family.name}: " + ", ".join(f"{p} (default)" if p == default else p
                                              for p in family.precisions) in inspect
    assert "--engine-role ROLE engine role (any case); bert: decode; qwen3: prefill, decode " \
           "--model-revision" in inspect  # qwen3's two layouts: split and unified
    assert "qwen3: split (default), unified" in inspect and "qwen3: default 4096" in inspect


def test_choices_parse_in_any_case():
    args = cli.parser().parse_args(["graph", "inspect", "--snapshot", "g.json", "--engine-role",
                                    "DECODE", "m", "--precision", "BF16",
                                    "--decoder-engine-layout", "Unified"])
    assert (args.engine_role, args.precision, args.decoder_engine_layout) == ("decode", "bf16",
                                                                             "unified")
    assert cli.parser().parse_args(["embed", "b", "--prompt", "x", "--pooling", "MEAN"]).pooling == "mean"


@pytest.mark.parametrize("argv, usage", [
    (["graph", "list", "g.json", "--bogus"], "usage: trtmc graph list "),
    (["bind", "manifest", "s.json", "--library", "k.so", "-o", "m.json", "--bogus"],
     "usage: trtmc bind manifest "),
    (["embed", "b.bundle", "--prompt", "x", "--pooling", "max"], "usage: trtmc embed "),
    (["--bogus", "graph", "list", "g.json"], "usage: trtmc [-h]"),
])
def test_a_wrong_flag_prints_that_commands_usage(argv, usage):
    rc, out, err = trtmc(*argv)
    assert rc == 2 and out == "" and err.startswith(usage), err
    assert "error: unrecognized arguments: --bogus" in err or "invalid choice: 'max'" in err


def test_version():
    rc, out, _ = trtmc("--version")
    assert rc == 0 and out.startswith("trtmc ")


def test_shell_completion(tmp_path):
    rc, script, _ = trtmc("completion", "bash")
    assert rc == 0 and "_shtab_trtmc" in script
    (tmp_path / "trtmc.bash").write_text(script)
    (tmp_path / "g.json").write_text("{}")

    def complete(*words):
        cmd = (f"source {tmp_path / 'trtmc.bash'}; COMP_WORDS=(trtmc {' '.join(words)}); "
               f"COMP_CWORD={len(words)}; _shtab_trtmc; echo \"${{COMPREPLY[@]}}\"")
        return subprocess.run(["bash", "-c", cmd], cwd=tmp_path, capture_output=True, text=True,
                              check=True).stdout.split()

    assert complete("graph", "l") == ["list"]
    assert complete("embed", "x.bundle", "--pooling", "''") == ["mean"]
    assert complete("graph", "list", "g.") == ["g.json"]  # paths complete as files
    rc, script, _ = trtmc("completion", "zsh")
    assert rc == 0 and script.startswith("#compdef trtmc")


# -- messages name what the user typed ---------------------------------------------------------
@pytest.mark.parametrize("model, options, message", [
    ("tiny_bert", ["--precision", "int8"], "--precision int8: expected one of fp16, fp32"),
    ("tiny_bert", ["--sequence-length", "100000"], "--sequence-length 100000: expected 1..512"),
    ("tiny_qwen3", ["--max-cache-length", "100000"], "--max-cache-length 100000: expected 1..512"),
    ("tiny_bert", ["--max-cache-length", "64"], "--max-cache-length: does not apply to the bert "
                                                "family (its build options: --precision, "
                                                "--sequence-length)"),
    ("tiny_bert", ["--decoder-engine-layout", "unified"],
     "--decoder-engine-layout: does not apply to the bert family (its build options: --precision, "
     "--sequence-length)"),
    ("tiny_qwen3", ["--engine-role", "prefill", "--decoder-engine-layout", "unified"],
     "--engine-role prefill: not a role of this model (valid roles: decode)"),
])
def test_build_options_are_named_by_their_flags(request, tmp_path, model, options, message):
    argv = ["graph", "inspect", "--snapshot", tmp_path / "g.json", request.getfixturevalue(model)]
    if "--engine-role" not in options:
        argv += ["--engine-role", "decode"]
    rc, out, err = trtmc(*argv, *options)
    assert rc == 2 and out == "" and err.startswith(f"trtmc: error: {message}"), err
    assert len(err.splitlines()) == 1 and not (tmp_path / "g.json").exists()


@pytest.mark.slow
def test_library_not_found_names_the_flag(encoder, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, out, err = trtmc("bind", "manifest", encoder["work"] / "res0.selection.json", "--library",
                         "nope.so", "-o", "m.json")
    assert (rc, out, err) == (2, "", "trtmc: error: --library nope.so: not found\n")
    assert list(tmp_path.iterdir()) == []  # no manifest, no staged temp file left


def _inputs(encoder, tmp_path) -> dict[str, Path]:
    """Copies of what the cases below read, so a regression damages only these."""
    import shutil
    for name in ("residual_add.cu", "trtmc_kernel.h"):
        shutil.copy(ROOT / "examples/byok" / name, tmp_path / name)
    for name in ("g.json", "res0.selection.json", "residual_add.so", "bindings.json"):
        shutil.copy(encoder["work"] / name, tmp_path / name)
    (tmp_path / "ledger.jsonl").write_text("")
    os.mkfifo(tmp_path / "fifo")
    return {p.name: p for p in tmp_path.iterdir()}


@pytest.mark.parametrize("argv, output, message", [
    (["kernel", "build", "{residual_add.cu}", "--cpu-only", "-o", "{residual_add.cu}"],
     "residual_add.cu", "-o {residual_add.cu}: is {residual_add.cu}, which is read here"),
    (["kernel", "build", "{residual_add.cu}", "--cpu-only", "-o", "{trtmc_kernel.h}"],
     "trtmc_kernel.h", "-o {trtmc_kernel.h}: is {trtmc_kernel.h}, which is read here"),
    (["bind", "manifest", "{res0.selection.json}", "--library", "{residual_add.so}", "-o",
      "{residual_add.so}"], "residual_add.so", "-o {residual_add.so}: is {residual_add.so}"),
    (["bind", "check", "SLOT", "--kernel-bindings", "{bindings.json}", "--device", "cpu",
      "--report", "{residual_add.so}"], "residual_add.so",
     "--report {residual_add.so}: is {residual_add.so}, which is read here"),
    (["graph", "select", "{g.json}", "--nodes", "encoder.layers.0.attention_residual_add",
      "--binding-id", "r", "--workspace-bytes", "0", "-o", "{g.json}"], "g.json", "-o {g.json}: is {g.json}"),
    (["gate", "history", "{ledger.jsonl}", "--plot", "{ledger.jsonl}"], "ledger.jsonl",
     "--plot {ledger.jsonl}: is {ledger.jsonl}"),
    (["graph", "select", "{g.json}", "--nodes", "encoder.layers.0.attention_residual_add",
      "--binding-id", "r", "--workspace-bytes", "0", "-o", "{fifo}"], "fifo",
     "{fifo}: not a regular file (a FIFO, socket or device is never replaced)"),
])
@pytest.mark.slow
def test_an_output_never_replaces_what_the_command_reads(encoder, tmp_path, argv, output, message):
    """Before: each of these wrote over its input (the FIFO became a regular file: as root,
    `--output /dev/null` replaced the device)."""
    files = {f"{{{name}}}": str(p) for name, p in _inputs(encoder, tmp_path).items()}
    fill = lambda text: functools.reduce(lambda t, kv: t.replace(*kv), files.items(), text)  # noqa: E731
    target = tmp_path / output
    before = None if output == "fifo" else target.read_bytes()
    rc, out, err = trtmc(*[encoder["slot"] if a == "SLOT" else fill(a) for a in argv])
    assert rc == 2 and err.count("\n") == 1 and fill(message) in err, err
    assert stat.S_ISFIFO(target.stat().st_mode) if before is None else target.read_bytes() == before


@pytest.mark.slow
def test_a_prompt_that_is_not_utf8_is_one_usage_error(encoder):
    """Before: the argv bytes reached the tokenizer as lone surrogates: a TypeError traceback."""
    rc, _, err = trtmc("embed", encoder["native"], "--prompt", b"\xff\xfe".decode(errors="surrogateescape"))
    assert rc == 2 and err.splitlines()[-1].endswith(
        "argument --prompt: not valid UTF-8 (byte 0xff at character 0)")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.slow
def test_a_full_stdout_is_one_line_not_a_traceback(encoder):
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "pipeline.cli", "graph", "list",
                               str(encoder["work"] / "g.json")], stdout=full, stderr=subprocess.PIPE,
                              text=True, cwd=ROOT, timeout=120)
    assert (proc.returncode, proc.stderr) == (2, "trtmc: error: writing the output: No space left on "
                                                 "device\n")


@pytest.mark.slow
def test_sampling_flags_are_checked_before_any_model_is_loaded(encoder):
    rc, _, err = trtmc("run", encoder["native"], "--prompt", "x", "--max-new-tokens", "1",
                       "--top-p", "5")
    assert rc == 2 and err.splitlines()[-1].endswith(
        "argument --top-p: 5.0 is out of range (expected (0, 1])") and "lowering" not in err
    rc, _, err = trtmc("run", encoder["native"], "--prompt", "x", "--max-new-tokens", "1",
                       "--temperature", "inf")
    assert rc == 2 and "argument --temperature: inf is out of range" in err


@pytest.mark.slow
def test_a_text_longer_than_the_bundle_is_cut_with_a_warning(encoder):
    rc, _, err = trtmc("embed", encoder["native"], "--prompt", "word " * 100, "--device", "cpu")
    assert rc == 0 and "tokens cut to the bundle's sequence length 32" in err


def test_a_kernel_source_that_is_a_folder_is_named_so(tmp_path):
    rc, _, err = trtmc("kernel", "build", tmp_path, "--cpu-only", "-o", tmp_path / "k.so")
    assert (rc, err) == (2, f"trtmc: error: {tmp_path}: kernel source is a directory\n")


def test_a_closed_stdout_is_no_traceback():
    proc = subprocess.run(["bash", "-c", f"{sys.executable} -m pipeline.cli completion bash >&-"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.slow
def test_device_is_named_by_its_flag(encoder):
    rc, _, err = trtmc("embed", encoder["native"], "--prompt", "x", "--device", "tpu")
    assert rc == 2 and err == "trtmc: error: --device tpu: expected cpu, cuda, cuda:N or auto\n"


@pytest.mark.gpu
@pytest.mark.slow
def test_a_cuda_device_past_the_last_is_one_line(encoder):
    import torch
    n = torch.cuda.device_count()
    rc, _, err = trtmc("embed", encoder["native"], "--prompt", "x", "--device", f"cuda:{n}")
    assert rc == 2 and err.startswith(f"trtmc: error: --device cuda:{n}: this machine has {n} "
                                      f"CUDA device"), err


# -- progress ----------------------------------------------------------------------------------
def _bar_output(*, ask=None, env=None, monkeypatch) -> str:
    if env is not None:
        monkeypatch.setenv("TRTMC_PROGRESS", env)
    progress.ask(ask)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), progress.bar(3, "trials") as bar:
        for i in range(3):
            bar.update(1, note=f"trial {i}")
    return err.getvalue()


def test_progress_is_quiet_off_a_terminal_unless_asked(monkeypatch):
    assert _bar_output(monkeypatch=monkeypatch) == ""          # stderr here is not a terminal
    assert _bar_output(env="0", ask=True, monkeypatch=monkeypatch) == "trials  3/3  trial 2  0.0s\n"
    assert _bar_output(env="1", monkeypatch=monkeypatch) == "trials  3/3  trial 2  0.0s\n"
    assert _bar_output(env="0", monkeypatch=monkeypatch) == ""


def test_a_bar_ended_early_says_whether_it_failed_or_was_stopped(monkeypatch):
    progress.ask(True)
    for error, note in ((ValueError("bad"), "failed"), (SystemExit(143), "stopped"), (KeyboardInterrupt(), "stopped")):
        err = io.StringIO()
        with contextlib.suppress(BaseException), contextlib.redirect_stderr(err), progress.bar(3, "probe") as bar:
            bar.update(1)
            raise error
        assert err.getvalue().splitlines()[-1].startswith(f"probe  1/3  {note}  "), (error, err.getvalue())


def test_a_spinner_redraws_while_the_caller_blocks(monkeypatch):
    progress.ask(True)
    monkeypatch.setattr(progress, "LOG_INTERVAL", 0.01)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        line = progress.spinner("compiling k.cu")
        time.sleep(0.2)
        line.close()
    lines = err.getvalue().splitlines()
    assert len(lines) >= 3 and all(x.startswith("compiling k.cu  ") and x.endswith("s") for x in lines)
    assert not line._ticker.is_alive()


def test_the_tensorrt_monitor_shows_the_builder_phase():
    from pipeline.trt import plans, trt
    progress.ask(True)
    with contextlib.redirect_stderr(io.StringIO()):
        line = progress.spinner("decode plan")
        monitor = plans._monitor(line)
        assert isinstance(monitor, trt.IProgressMonitor)
        monitor.phase_start("Building engine", None, 6)
        assert monitor.step_complete("Building engine", 2) is True and line.note == "Building engine 3/6"
        monitor.phase_start("Tactic selection", "Building engine", 4)
        monitor.phase_finish("Tactic selection")
        line.close()


@pytest.mark.slow
def test_plan_builds_and_compiles_report_progress_on_stderr_only(encoder):
    _, out, err = encoder["runs"]["build"]
    assert out == f"native bundle {encoder['native']}\n"
    assert "decode plan  built  " in err
    _, out, err = encoder["runs"]["kernel"]
    assert out == "" and "compiling residual_add.cu  " in err


@pytest.mark.slow
def test_benchmark_runs_report_progress(tiny_qwen3, tmp_path):
    bundle = tmp_path / "q.bundle"
    assert trtmc("build", tiny_qwen3, "--max-cache-length", "32", "-o", bundle)[0] == 0
    rc, out, err = trtmc("--progress", "run", bundle, "--prompt", "hi", "--max-new-tokens", "2",
                         "--greedy", "--warmup", "1", "--benchmark", "2", "--device", "cpu")
    assert rc == 0 and "benchmark runs  3/3  timed  " in err
    assert len(out.splitlines()) == 1 and out.startswith("generated_tokens_mean=2.000 runs=2 ")


# -- --json and embed ----------------------------------------------------------------------------
@pytest.mark.slow
def test_bind_check_json(encoder):
    rc, out, _ = trtmc("--progress", "bind", "check", encoder["slot"], "--kernel-bindings",
                       encoder["bindings"], "--device", "cpu", "--json")
    report = orjson.loads(out)  # the whole of stdout
    assert rc == 0 and report["passed"] and [s["binding_id"] for s in report["slots"]] == ["res0"]
    rc, out, _ = trtmc("bind", "check", encoder["slot"], "--kernel-bindings", encoder["bindings"],
                       "--device", "cpu")
    assert rc == 0 and out.startswith("PASS  res0  FP16 ")


TEXT = "A kernel author replaces one region."


def _embed(bundle, *flags):
    rc, out, err = trtmc("--progress", "embed", bundle, "--prompt", TEXT, "--device", "cpu", *flags)
    assert rc == 0, err
    doc = orjson.loads(out)
    assert set(doc) == {"embedding", "shape"}
    return torch.tensor(doc["embedding"]).reshape(doc["shape"])


@pytest.mark.slow
def test_embed_pooling_and_normalize(encoder):
    full = _embed(encoder["native"])
    assert full.shape == (32, 64)  # the documented default: the full hidden state [S, H]
    real = len(Bundle.open(encoder["native"]).tokenizer().encode(TEXT))
    assert 1 < real < 32
    mean = _embed(encoder["native"], "--pooling", "mean")
    assert mean.shape == (64,)
    torch.testing.assert_close(mean, full[:real].mean(0), atol=1e-3, rtol=1e-3)
    assert not torch.allclose(mean, full.mean(0), atol=1e-3)  # padded positions are left out
    unit = _embed(encoder["native"], "--pooling", "mean", "--normalize")
    torch.testing.assert_close(unit, mean / mean.norm(), atol=1e-3, rtol=1e-3)
    rows = _embed(encoder["native"], "--normalize")
    torch.testing.assert_close(rows.norm(dim=-1), torch.ones(32))


@pytest.mark.parametrize("argv, flag", [
    (["run", "x.bundle", "--prompt", "a", "--max-new-tokens", "99999999999"], "--max-new-tokens"),
    (["run", "x.bundle", "--prompt", "a", "--max-new-tokens", "3", "--seed", str(2 ** 64)], "--seed"),
    (["run", "x.bundle", "--prompt", "a", "--max-new-tokens", "3", "--benchmark", "-1"], "--benchmark"),
    (["graph", "select", "g.json", "--nodes", "node:1", "--binding-id", "a", "--workspace-bytes",
      "1180591620717411303424", "-o", "s.json"], "--workspace-bytes"),
    (["build", "m", "--max-cache-length", "1e30", "-o", "x.bundle"], "--max-cache-length"),
])
def test_numbers_out_of_range_are_one_usage_line(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"argument {flag}:" in err and "Traceback" not in err


@pytest.mark.parametrize("argv, message", [
    (["graph", "inspect", "--snapshot", "{tmp}/g.json", "--engine-role", "", "{model}"],
     "--engine-role '': not a role of this model"),
    (["embed", "{native}", "--prompt", "x", "--device", "cpu", "--checkpoint", ""],
     "--checkpoint '': an empty path"),
    (["gate", "history", "{tmp}/l.jsonl", "--plot", ""], "--plot '': expected the path of a PNG"),
    (["gate", "history", "{tmp}/l.jsonl", "--plot", "{tmp}"], "expected the path of a PNG file"),
])
@pytest.mark.slow
def test_an_empty_or_folder_value_is_refused_not_ignored(encoder, tiny_bert, tmp_path, argv, message):
    """Before: an empty --engine-role captured the default role, an empty --checkpoint used the
    recorded one, an empty --plot drew nothing, and a folder as --plot failed after the table."""
    (tmp_path / "l.jsonl").write_text("")
    fill = {"{tmp}": str(tmp_path), "{model}": str(tiny_bert), "{native}": str(encoder["native"])}
    rc, out, err = trtmc(*[functools.reduce(lambda t, kv: t.replace(*kv), fill.items(), a) for a in argv])
    assert (rc, out) == (2, "") and message in err and err.count("\n") == 1, err
