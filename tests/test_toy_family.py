"""A model family defined inside the tests (``tests/toy_family/``: its own model, converter, pipeline and
family object) plugs into jaxdit with ONE ``jaxdit.families.register`` call: ``jaxdit generate`` runs it on
a ring2 x ulysses2 x tensor2 mesh equal to one device, ``jaxdit plan`` prices its presets and ``--help``
names them, and PipeFusion, for which it has no stage layout, is refused in one line.

The fixture registers the toy for this module only and takes it out again, so no other test sees it.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import tolerance as tol
from toy_family import TOY
from toy_family.converter import random_params, write_folder
from toy_family.model import ToyConfig

from jaxdit import cli, families

#: 5 text and 6 x 7 = 42 image tokens: neither divides the 4 sequence shards, so padding and the key
#: mask are exercised; CFG (guidance 3) runs both branches.
BATCH, TEXT, HEIGHT, WIDTH, STEPS = 2, 5, 6, 7, 3


@pytest.fixture(scope="module")
def toy():
    families.register(TOY)
    try:
        yield TOY
    finally:
        families.FAMILIES.pop(TOY.name)


@pytest.fixture(scope="module")
def toy_files(toy, tmp_path_factory):
    root = tmp_path_factory.mktemp("toy")
    cfg = ToyConfig.preset("toy-small")
    folder = write_folder(root / "toy-small", cfg, random_params(cfg))
    rng = np.random.default_rng(1)
    embeds = rng.standard_normal((BATCH, TEXT, cfg.text_dim)).astype(np.float32)
    np.savez(root / "embeds.npz", prompt_embeds=embeds, negative_prompt_embeds=embeds[::-1].copy())
    return root, folder


def _generate_argv(toy_files, *extra: str) -> list[str]:
    root, folder = toy_files
    argv = ["generate", "--model", "toy-small", "--weights", str(folder), "--prompt_embeds"]
    argv += [str(root / "embeds.npz"), "--height", str(HEIGHT), "--width", str(WIDTH), "--steps", str(STEPS)]
    return argv + ["--guidance_scale", "3", "--seed", "4", *extra]


def test_the_toy_is_found_through_the_registry(toy, toy_files):
    _, folder = toy_files
    assert families.detect_family(folder) is toy
    assert families.preset("toy-wide")[0] is toy
    assert families.for_config(ToyConfig()) is toy


def test_generate_on_a_mesh_equals_one_device(toy_files, tmp_path, capsys, monkeypatch):
    """``jaxdit generate`` on ring2 x ulysses2 x tensor2 (8 emulated devices, in-process) against the same
    request on one device: the latents agree to fp32 rounding, and the model moved them off the noise.
    The run builds one ``DeviceMesh`` and passes it through: nothing reads the degrees back from a mesh."""
    from jaxdit.mesh import ParallelConfig

    read_back = []
    from_mesh = ParallelConfig.from_mesh.__func__
    monkeypatch.setattr(
        ParallelConfig, "from_mesh", classmethod(lambda cls, m: read_back.append(m) or from_mesh(cls, m))
    )
    mesh, single = tmp_path / "mesh.npy", tmp_path / "single.npy"
    degrees = ["--ring_degree", "2", "--ulysses_degree", "2", "--tensor_parallel_degree", "2"]
    argv = _generate_argv(toy_files, *degrees, "--emulate_devices", "8", "--output", str(mesh))
    assert cli.main(argv) == 0, capsys.readouterr().err
    assert read_back == []  # before: the loaders, the pipeline, its forward and CFG's two helpers did
    printed = capsys.readouterr().out
    assert "toy-small: ring2 x ulysses2 x tensor2 on 8 cpu device(s)" in printed
    assert cli.main(_generate_argv(toy_files, "--output", str(single))) == 0, capsys.readouterr().err
    got, want = np.load(mesh), np.load(single)
    assert got.shape == (BATCH, 4, HEIGHT, WIDTH)
    tol.check(got, want, tol.SAME_SEED, "toy: ring2 x ulysses2 x tensor2 vs one device (CLI)")
    noise = np.random.default_rng(4).standard_normal(got.shape, dtype=np.float32)
    assert np.abs(want - noise).max() > 0.5  # the forward did something the comparison can catch


def test_first_block_cache_through_the_toys_hook_on_a_mesh(toy_files, tmp_path, capsys):
    """``--use_fbcache`` reads the toy's ``cache_metric_stream``: on the mesh it skips what one device
    skips (the run's own ``--compare_single_device`` check) and the latents agree to fp32 rounding."""
    out = tmp_path / "cached.npy"
    degrees = ["--ring_degree", "2", "--ulysses_degree", "2", "--tensor_parallel_degree", "2"]
    argv = _generate_argv(toy_files, *degrees, "--emulate_devices", "8", "--output", str(out))
    argv[argv.index("--steps") + 1] = "8"
    argv += ["--use_fbcache", "--cache_threshold", "0.6", "--compare_single_device"]
    assert cli.main(argv) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "cache decisions the same as the single-device run's" in printed
    skipped = re.search(r"(\d+) of 8 steps ran every block", printed)
    assert skipped is not None and int(skipped.group(1)) < 8, printed  # the cache skipped something
    error = float(re.search(r"max \|difference\| to the single-device result: (\S+)", printed).group(1))
    tol.check_error(error, tol.SAME_SEED, np.abs(np.load(out)).max(), "toy FBCache: mesh vs one device")


def test_convert_then_generate_from_the_orbax_folder(toy_files, tmp_path, capsys):
    """``jaxdit convert`` writes the toy's folder as orbax (the family's name recorded in it); ``jaxdit
    generate`` without ``--model`` finds the family from either folder and makes the same latents."""
    _, folder = toy_files
    assert cli.main(["convert", str(folder), str(tmp_path / "orbax")]) == 0, capsys.readouterr().err
    outputs = []
    for weights in (folder, tmp_path / "orbax"):
        argv = _generate_argv(toy_files, "--output", str(tmp_path / f"{len(outputs)}.npy"))
        argv[argv.index("--weights") + 1] = str(weights)
        del argv[argv.index("--model") : argv.index("--model") + 2]
        assert cli.main(argv) == 0, capsys.readouterr().err
        outputs.append(np.load(tmp_path / f"{len(outputs)}.npy"))
    np.testing.assert_array_equal(outputs[1], outputs[0])


def test_the_toys_own_call_argument_goes_through_generate(toy_files, tmp_path, capsys):
    """``--embedding_scale`` is declared by the toy's pipeline alone (``call_options``): ``jaxdit
    generate`` parses it, passes it to the call, and the run equals the one whose embeddings file holds
    the scaled embeddings; a family that does not declare it refuses it in one line."""
    root, _ = toy_files
    with np.load(root / "embeds.npz") as f:
        np.savez(tmp_path / "scaled.npz", **{k: 2 * f[k] for k in f.files})
    scaled, flagged = tmp_path / "scaled.npy", tmp_path / "flagged.npy"
    argv = _generate_argv(toy_files, "--output", str(scaled))
    argv[argv.index("--prompt_embeds") + 1] = str(tmp_path / "scaled.npz")
    assert cli.main(argv) == 0, capsys.readouterr().err
    assert cli.main(_generate_argv(toy_files, "--embedding_scale", "2", "--output", str(flagged))) == 0
    np.testing.assert_array_equal(np.load(flagged), np.load(scaled))
    plain = tmp_path / "plain.npy"
    assert cli.main(_generate_argv(toy_files, "--output", str(plain))) == 0, capsys.readouterr().err
    assert not np.array_equal(np.load(plain), np.load(flagged))  # the flag changed the run
    capsys.readouterr()
    out = tmp_path / "digits.png"
    assert cli.main(["generate", "--embedding-scale", "2", "--steps", "1", "--output", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "jaxdit generate: error: --embedding_scale applies to Toy DiT models; tiny-digits does not take it"
    )
    assert not out.exists()


def test_plan_prices_a_toy_preset(toy, capsys):
    assert cli.main(["plan", "--model", "toy-small", "--devices", "4", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    text = json.dumps(plan)
    assert "toy-small" in text and "ring2 x ulysses2" in text and "tensor4" in text


def test_plan_ranks_the_pipefusion_it_cannot_run_last(toy, capsys):
    """The toy has no PipeFusion stage layout: its PipeFusion configurations are 'modelled only' and come
    after every configuration it can run, whatever their modelled latency, and the table says why."""
    from jaxdit.plan.search import plan
    from jaxdit.plan.workload import Workload

    report = plan(Workload.create("toy-wide"), 4)
    runs = [p.runnable for p in report.plans]
    assert runs.count(False) == sum(p.config.pipefusion > 1 for p in report.plans) > 0
    assert runs == sorted(runs, reverse=True), [p.name for p in report.plans]
    assert cli.main(["plan", "--model", "toy-wide", "--devices", "4"]) == 0
    text = capsys.readouterr().out
    assert f"{runs.count(False)} configuration(s) marked 'modelled only' are ranked after" in text


@pytest.mark.parametrize("command", ["generate", "plan"])
def test_help_lists_the_toy_presets(toy, command, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main([command, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "toy-small" in out and "toy-wide" in out
    if command == "generate":  # the toy's own flag, from its pipeline's declaration
        assert "Toy DiT: multiply the prompt embeddings by this" in " ".join(out.split())


def test_pipefusion_without_a_stage_layout_is_refused_in_one_line(toy_files, tmp_path, capsys):
    out = tmp_path / "pf.npy"
    argv = _generate_argv(toy_files, "--pipefusion_parallel_degree", "2", "--output", str(out))
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "Toy DiT has no PipeFusion stage layout" in err and "--pipefusion_parallel_degree 2" in err
    assert not out.exists()
