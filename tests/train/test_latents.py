"""Latent-space training with a tiny randomly initialised AutoencoderKL (built from a config, no hub access) on a
small image folder made here: prepare -> train -> resume -> sample -> evaluate -> export -> load, and every bad input."""

import json

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers", reason="the latent tests need the latent extra: pip install -e '.[test]'")

from flm.latents import LatentFiles, load_vae
from flm.train import checkpoint

from ..metrics.standin import save_standin
from .conftest import TINY, load_entry, run_script
from .test_loop import assert_same_state, whole_and_resumed

RES = 16  # images 16 x 16 -> latents 4 x 8 x 8


def tiny_vae(seed: int = 0):
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 16),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=RES,
    ).eval()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Two VAE folders, an image folder (2 classes x 8 images), its latents, a tiny latent run, the FID stand-in."""
    from PIL import Image

    root = tmp_path_factory.mktemp("latents")
    for seed, name in ((0, "vae"), (1, "other_vae")):
        tiny_vae(seed).save_pretrained(root / name)
    g = np.random.default_rng(0)
    for c in ("cat", "dog"):
        (root / "images" / c).mkdir(parents=True)
        for i in range(8):
            Image.fromarray(g.integers(0, 256, (20, 24, 3), dtype=np.uint8)).save(root / "images" / c / f"{i}.png")
    rc, out, err = run_script(
        "prepare_latents",
        "data=imagefolder",
        f"data.root={root / 'images'}",
        f"data.resolution={RES}",
        f"vae={root / 'vae'}",
        f"out={root / 'lat'}",
        "shard_size=6",
        "batch_size=5",
        "device=cpu",
    )
    assert rc == 0, err
    run = root / "run"
    load_entry("train").run(_cfg(["data=latents", f"data.root={root / 'lat'}", "trainer.ema_sigma_rels=[0.1]"]), str(run))
    return {"root": root, "lat": root / "lat", "run": run, "standin": save_standin(root / "standin.pt")}


def _cfg(overrides, name="train"):
    from hydra import compose, initialize_config_dir

    from .conftest import ROOT

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose(config_name=name, overrides=(TINY if name == "train" else []) + list(overrides))


def test_prepare_writes_shards_flips_and_statistics(world):
    meta = json.loads((world["lat"] / "meta.json").read_text())
    assert meta["num_images"] == 16 and meta["resolution"] == RES and meta["latent_shape"] == [4, 8, 8]
    assert [s["n"] for s in meta["shards"]] == [6, 6, 4] and meta["scaling_factor"] == pytest.approx(0.18215)
    data = LatentFiles(str(world["lat"]))
    assert (data.channels, data.resolution, data.num_classes, len(data)) == (4, 8, 2, 16)
    # item 7 (shard 1) and its flip: the VAE's posterior means of the image and of the flipped image
    from flm.data import build_dataset

    images = build_dataset("imagefolder", root=str(world["root"] / "images"), resolution=RES)
    x, y = images.__getitems__([7])
    vae = load_vae(str(world["root"] / "vae"))
    with torch.no_grad():
        want = vae.encode(torch.cat([x, x.flip(-1)])).latent_dist.mean * 0.18215
    got, labels = data.__getitems__([7, 7 + 16])
    torch.testing.assert_close(got, want, atol=2e-3, rtol=1e-2)  # stored as float16
    assert labels.tolist() == [y.item()] * 2
    z = np.concatenate([np.load(world["lat"] / s["latents"]).astype(np.float64) for s in meta["shards"]])
    np.testing.assert_allclose(meta["channel_mean"], z.mean((0, 1, 3, 4)), atol=1e-4)
    np.testing.assert_allclose(meta["channel_std"], z.std((0, 1, 3, 4)), atol=1e-4)


def test_the_loader_reads_the_stored_flips(world):
    from flm.data import Loader

    data = LatentFiles(str(world["lat"]))
    loader = Loader(data, batch_size=16, rank=0, world_size=1, seed=0, hflip=True)
    perm, flips = loader._epoch_plan(0)
    x, y = loader.next()
    torch.testing.assert_close(x, data.__getitems__((perm + 16 * flips).tolist())[0])
    assert 0 < flips.sum() < 16


def test_a_latent_run_records_its_vae_and_decodes_its_grid(world):
    bundle = checkpoint.load(checkpoint.find_checkpoint(str(world["run"])))
    assert bundle["model_args"]["in_channels"] == 4 and bundle["model_args"]["input_size"] == 8
    assert bundle["config"]["latents"]["vae"] == str(world["root"] / "vae")
    from PIL import Image

    grid = Image.open(world["run"] / "samples" / "step-00000004.png")
    assert grid.mode == "RGB" and grid.size == (2 + 2 * (RES + 2), 2 + 2 * (RES + 2))  # 4 decoded 16 x 16 images


def test_a_latent_run_resumes_bit_exactly(world, tmp_path, train_run):
    common = [
        "data=latents",
        f"data.root={world['lat']}",
        "trainer.ckpt_every=2",
        "trainer.keep_last=0",
        "trainer.ema_sigma_rels=[0.1]",
        "data.num_workers=0",
    ]
    a, b = whole_and_resumed(tmp_path, train_run, common, steps=4, stop=2)
    for part in ("model", "ema", "optimizer", "data", "rng", "step"):
        assert_same_state(a[part], b[part], part)


def test_sample_evaluate_export_and_load(world, tmp_path):
    rc, out, err = run_script(
        "sample", f"ckpt={world['run']}", "n=5", "batch_size=3", f"out={tmp_path / 's'}", "device=cpu", "ema=sigma_rel0.1"
    )
    assert rc == 0, err
    ckpt = np.load(tmp_path / "s.npz")
    assert ckpt["images"].shape == (5, RES, RES, 3) and ckpt["images"].dtype == np.uint8  # decoded images

    rc, out, err = run_script("export", f"ckpt={world['run']}", f"out={tmp_path / 'export'}", "ema=sigma_rel0.1")
    assert rc == 0, err
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["vae"] == str(world["root"] / "vae") and config["ema"] == "sigma_rel0.1"
    assert sorted(p.name for p in (tmp_path / "export").iterdir()) == ["config.json", "model.safetensors"]
    rc, out, err = run_script(
        "sample", f"ckpt={tmp_path / 'export'}", "n=5", "batch_size=5", f"out={tmp_path / 'e'}", "device=cpu"
    )
    assert rc == 0, err
    assert np.array_equal(np.load(tmp_path / "e.npz")["images"], ckpt["images"])  # the same samples as the checkpoint

    for source in (world["run"], tmp_path / "export"):
        report = tmp_path / f"fid-{source.name}.json"
        rc, out, err = run_script(
            "evaluate",
            f"ckpt={source}",
            "n=6",
            "steps=1",
            "batch_size=4",
            "device=cpu",
            f"inception={world['standin']}",
            f"fid_cache={tmp_path / 'cache'}",
            f"out={report}",
        )
        assert rc == 0, err
        results = json.loads(report.read_text())["results"]
        assert set(results) == {"fid_steps1"} and np.isfinite(results["fid_steps1"])
    # the same images, so the same score, from the checkpoint and from its export (sigma_rel0.1 in both)
    scores = [json.loads((tmp_path / f"fid-{n}.json").read_text())["results"]["fid_steps1"] for n in ("run", "export")]
    rc, out, err = run_script(
        "evaluate",
        f"ckpt={world['run']}",
        "n=6",
        "steps=1",
        "batch_size=4",
        "device=cpu",
        "ema=sigma_rel0.1",
        f"inception={world['standin']}",
        f"fid_cache={tmp_path / 'cache'}",
        f"out={tmp_path / 'fid-ema.json'}",
    )
    assert rc == 0, err
    assert json.loads((tmp_path / "fid-ema.json").read_text())["results"]["fid_steps1"] == pytest.approx(scores[1])


def _one_line_error(rc, err, expected):
    assert rc == 1 and len(err.strip().splitlines()) == 1 and err.startswith("error: ") and expected in err, err


@pytest.mark.parametrize(
    "override,expected",
    [
        ("data.resolution=32", "holds 16x16 images, but data.resolution=32"),
        ("data.vae=OTHER", "was encoded with VAE"),
    ],
)
def test_a_latent_folder_of_another_resolution_or_vae_is_refused(world, tmp_path, override, expected):
    override = override.replace("OTHER", str(world["root"] / "other_vae"))
    rc, out, err = run_script(
        "train", *TINY, "data=latents", f"data.root={world['lat']}", override, f"run_dir={tmp_path / 'run'}"
    )
    _one_line_error(rc, err, expected)


def test_a_missing_vae_is_refused(world, tmp_path):
    rc, out, err = run_script(
        "prepare_latents",
        "data=imagefolder",
        f"data.root={world['root'] / 'images'}",
        f"vae={tmp_path / 'no_vae'}",
        f"out={tmp_path / 'lat'}",
        "device=cpu",
    )
    _one_line_error(rc, err, "does not exist")
    assert not (tmp_path / "lat").exists()


def test_adm_reference_statistics_of_another_resolution_are_refused(world, tmp_path):
    ref = tmp_path / "VIRTUAL_imagenet32_labeled.npz"  # ADM's layout: images beside mu and sigma
    np.savez(ref, arr_0=np.zeros((3, 32, 32, 3), np.uint8), mu=np.zeros(32), sigma=np.eye(32))
    rc, out, err = run_script(
        "evaluate", f"ckpt={world['run']}", "n=4", "device=cpu", f"ref={ref}", f"inception={world['standin']}"
    )
    _one_line_error(rc, err, "32x32")
    assert "needs" in err and "16x16" in err


def test_export_of_a_run_without_ema_is_refused(tmp_path, train_run):
    train_run(tmp_path / "run", ["trainer.max_steps=1", "trainer.ema_decays=[]"])
    rc, out, err = run_script("export", f"ckpt={tmp_path / 'run'}", f"out={tmp_path / 'x'}")
    _one_line_error(rc, err, "keeps no EMA")


def test_a_trigflow_sigma_d_off_the_latents_scale_is_warned_about(world, tmp_path, caplog):
    import logging

    from flm.latents import LatentInfo

    info = LatentInfo.from_dict(json.loads((world["lat"] / "meta.json").read_text()), where="meta.json")
    rms = info.rms()
    files = LatentFiles(str(world["lat"]))
    z, _ = files.__getitems__(list(range(2 * len(files))))  # every latent and its flip, as training reads them
    assert rms == pytest.approx(z.square().mean().sqrt().item(), rel=1e-2)  # the statistics describe what training reads
    with caplog.at_level(logging.INFO, logger="flm"):
        load_entry("train").run(
            _cfg(["data=latents", f"data.root={world['lat']}", "objective=scm", f"objective.sigma_d={20 * rms:g}"]),
            str(tmp_path / "far"),
        )
    assert any("objective.sigma_d=" in r.message and "RMS" in r.message for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="flm"):
        load_entry("train").run(
            _cfg(["data=latents", f"data.root={world['lat']}", "objective=scm", f"objective.sigma_d={rms:g}"]),
            str(tmp_path / "near"),
        )
    assert not any("RMS" in r.message for r in caplog.records)
