"""A checkpoint whose integrity manifest was deleted is not loaded silently: damaged where this
workdir's checkpoints are written with one, a loud warning for an older rljax's."""
import jax.numpy as jnp

from rljax.train.core import checkpoint as ckpt_lib, manifest


def _save_two(directory):
    with ckpt_lib.CheckpointManager(directory, async_save=False) as ckpt:
        for step in (1, 2):
            ckpt.save(step, {"w": jnp.arange(64.0) + step}, {"phase": 0})
    return ckpt_lib.CheckpointManager(directory, async_save=False)


def _flip_a_bit(step_dir):
    data = max((p for p in step_dir.rglob("*") if p.is_file()
                and p.name != manifest.MANIFEST_FILE), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 1
    data.write_bytes(bytes(raw))


def test_a_deleted_manifest_is_damage_where_manifests_are_in_use(tmp_path):
    directory = tmp_path / "checkpoints"
    with _save_two(str(directory)) as ckpt:
        assert manifest.manifests_since(str(directory)) == 1
        assert ckpt.verify(2) is None
        (directory / "2" / manifest.MANIFEST_FILE).unlink()
        _flip_a_bit(directory / "2")
        problem = ckpt.verify(2)
        assert problem is not None and "rljax_manifest.json is missing" in problem
        assert ckpt.verify(1) is None


def test_a_deleted_manifest_is_damage_even_with_the_marker_deleted_too(tmp_path):
    """Marker and manifest both deleted: an earlier step's manifest still says this workdir's
    checkpoints are written with one, so the bit-flipped step is refused, not restored."""
    directory = tmp_path / "checkpoints"
    with _save_two(str(directory)) as ckpt:
        (directory / manifest.MANIFESTS_SINCE_FILE).unlink()
        (directory / "2" / manifest.MANIFEST_FILE).unlink()
        _flip_a_bit(directory / "2")
        problem = ckpt.verify(2)
        assert problem is not None and "rljax_manifest.json is missing" in problem
        assert ckpt.verify(1) is None


def test_an_older_rljaxs_checkpoint_without_a_manifest_loads_with_a_warning(tmp_path, capsys):
    directory = tmp_path / "checkpoints"
    with _save_two(str(directory)) as ckpt:
        (directory / manifest.MANIFESTS_SINCE_FILE).unlink()  # as an older rljax left it
        (directory / "2" / manifest.MANIFEST_FILE).unlink()
        (directory / "1" / manifest.MANIFEST_FILE).unlink()
        assert ckpt.verify(2) is None
        err = capsys.readouterr().err
        assert "warning: checkpoint 2 has no rljax_manifest.json" in err
        assert ckpt.restore(2).meta["phase"] == 0
        ckpt.save(3, {"w": jnp.arange(64.0)}, {"phase": 0})   # from here on: manifests
        ckpt.wait_until_finished()
        assert manifest.manifests_since(str(directory)) == 3
        assert ckpt.verify(2) is None   # still older than the first manifest: a warning
