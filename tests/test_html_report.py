"""`moelab report --html`: one self-contained page, checked in a real browser (headless Chromium)."""

from __future__ import annotations

import csv
import json
import re
import shutil
import subprocess

import pytest
import yaml

from moelab.cli import main

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="headless Chromium is not installed (.ci/run installs Debian's chromium)"
)
#: validation curve, three log.csv routing curves, three diagnostics curves, a heat map per group
FIGURES = 1 + 3 + 3 + 2


def fake_run(path, method, seed, shift):
    """A finished run folder: config, metrics, a log with the routing columns, diagnostics with curves."""
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(
        yaml.safe_dump({"task": "lm", "method": method, "arch": "switch", "metric": "bpc"})
    )
    (path / "metrics.json").write_text(
        json.dumps({"method": method, "seed": seed, "test_bpc": 1.5 + shift, "val_bpc": 1.6 + shift})
    )
    with open(path / "log.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "loss", "router_entropy", "load_cv", "max_vio", "val_loss", "val_bpc"])
        for step in range(1, 21):
            val = 2.0 - step * 0.02 + shift if step % 5 == 0 else ""
            w.writerow([step, 1.0, 2.0 - step * 0.01, 0.3 + shift, 0.5 + step * 0.01 + shift, "", val])
    diagnostics = {
        "tokens_used": 4096,
        "curve_steps": [5, 10, 15, 20],
        "saturation_mean": [0.5 + shift, 0.7, 0.9, 1.0],
        "change_rate_mean": [None, 0.3, 0.2 + shift, 0.1],
        "jain_curve_mean": [0.8, 0.85, 0.9 + shift, 0.9],
        "jain_curve": [[0.7 + shift, 0.9], [0.8, 0.9], [0.85, 0.95], [0.9, 0.9]],
    }
    (path / "diagnostics.json").write_text(json.dumps(diagnostics))


@pytest.fixture
def page(tmp_path):
    for method, shifts in (("smoe", (0.0, 0.1)), ("xmoe", (0.05, 0.15))):
        for seed, shift in enumerate(shifts):
            fake_run(tmp_path / "runs" / f"{method}{seed}", method, seed, shift)
    (tmp_path / "runs" / "benchmark.md").write_text("| method | bpc |\n| smoe | 1.55 |\n")
    out = tmp_path / "report.html"
    assert (
        main(
            [
                "report",
                str(tmp_path / "runs"),
                "--reference",
                "smoe",
                "--out",
                str(tmp_path / "rep"),
                "--html",
                str(out),
            ]
        )
        == 0
    )
    return out


def test_the_html_report_holds_the_table_every_figure_and_nothing_from_the_network(page):
    text = page.read_text()
    assert text.count('<svg class="figure"') == FIGURES
    assert "<td>smoe</td>" in text and "<td>xmoe</td>" in text and "| smoe | 1.55 |" in text
    assert not re.search(r"""(src|href)\s*=""", text)  # no file, script or style is fetched to view it
    assert set(re.findall(r"https?://[^\s\"'<]+", text)) == {
        "http://www.w3.org/2000/svg"
    }  # a name, not a fetch
    # the validation curve's points are the means ± sd over the seeds: smoe at step 20, (1.6 + 1.7) / 2
    assert "<title>smoe (n=2): step 20, 1.65 ± 0.07071</title>" in text
    # the per-layer heat map of smoe: layer 0 at step 5 is the mean of 0.7 and 0.8 over its two runs
    assert "<title>layer 0, step 5: 0.75</title>" in text


def chromium(*args, tmp_path):
    flags = [
        "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr", "--v=0",
    ]  # fmt: skip
    return subprocess.run([CHROMIUM, *flags, *args], capture_output=True, text=True, timeout=120)


def console_messages(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if ":CONSOLE" in line]


@needs_chromium
def test_the_browser_check_sees_a_console_error(tmp_path):
    bad = tmp_path / "bad.html"
    bad.write_text("<!DOCTYPE html><html><body><script>undefinedFunction();</script></body></html>")
    done = chromium("--dump-dom", bad.as_uri(), tmp_path=tmp_path)
    assert any("undefinedFunction is not defined" in m for m in console_messages(done.stderr))


@needs_chromium
def test_headless_chromium_draws_every_figure_offline_without_a_console_error(page, tmp_path):
    done = chromium("--dump-dom", page.as_uri(), tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert console_messages(done.stderr) == []
    assert f'data-figures="{FIGURES}/{FIGURES}"' in done.stdout  # the page's script ran and measured each
    shot = tmp_path / "page.png"
    chromium(f"--screenshot={shot}", "--window-size=1280,2400", page.as_uri(), tmp_path=tmp_path)
    from PIL import Image

    image = Image.open(shot).convert("L")
    dark = sum(image.histogram()[:200])  # pixels darker than 200 of 255
    assert image.size == (1280, 2400) and dark > 0.01 * 1280 * 2400  # text, lines and cells, not a blank page
