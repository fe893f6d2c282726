"""Figures are written whole or not at all (evaluation/plots.save_figure)."""

import matplotlib
import pytest

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from megatron_specdec.evaluation.plots import save_figure  # noqa: E402


def _figure():
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    return fig


def test_figure_lands_whole_and_closed(tmp_path):
    fig = _figure()
    save_figure(fig, tmp_path / "speed.png", dpi=40)
    assert (tmp_path / "speed.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["speed.png"]
    assert not plt.fignum_exists(fig.number)


def test_failed_write_keeps_the_old_figure(tmp_path):
    path = tmp_path / "speed.notaformat"
    path.write_bytes(b"old figure")
    fig = _figure()
    with pytest.raises(ValueError):
        save_figure(fig, path, dpi=40)
    assert path.read_bytes() == b"old figure"
    assert [p.name for p in tmp_path.iterdir()] == ["speed.notaformat"]
    assert not plt.fignum_exists(fig.number)
