"""The CLI reference page: generated from the real parsers, it lists every subcommand and exactly the flags each
accepts, grouped by section; built by mkdocs and opened in headless Chromium at 1280x800, no flag name is broken
across lines."""

import argparse
import dataclasses
import html
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fastdpo.cli import build_parser
from fastdpo.commands.evaluate import EvalConfig
from fastdpo.commands.export import ExportConfig
from fastdpo.commands.infer import InferConfig
from fastdpo.config import TrainConfig
from fastdpo.config.flags import config_sections, section_names

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = next((p for p in (shutil.which("chromium"), shutil.which("chromium-browser"), shutil.which("google-chrome"))
                 if p), None)


def hook():
    spec = importlib.util.spec_from_file_location("cli_reference", ROOT / "docs/hooks/cli_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def listed_flags(page: str) -> dict[str, set[str]]:
    """Flags the page lists, by command: those under its own heading and those of the groups it links to."""
    groups: dict[str, set[str]] = {}  # group anchor -> flags listed under it
    for anchor, body in re.findall(r"^### .*? \{#([\w-]+)\}\n(.*?)(?=^##)", page + "\n##", flags=re.M | re.S):
        groups[anchor] = set(re.findall(r'class="cli-flag">([^<]+)<', body))
    out = {}
    for name, body in re.findall(r"^## (\S+) \{#[\w-]+\}\n(.*?)(?=^## |\Z)", page, flags=re.M | re.S):
        intro = body.split("\n### ")[0]
        linked = re.findall(r"\]\(#([\w-]+)\)", intro)
        own = re.findall(r"^### .*? \{#([\w-]+)\}", body, flags=re.M)
        out[name] = set().union(*(groups[a] for a in linked if a in groups), *(groups[a] for a in own))
    return out


def accepted_flags(parser: argparse.ArgumentParser) -> set[str]:
    return {a.option_strings[-1] if a.option_strings else a.dest.upper() for a in parser._actions
            if not isinstance(a, argparse._HelpAction)}


def test_every_command_and_exactly_its_flags_are_on_the_page():
    parser = build_parser()
    page = hook().render(parser)
    listed = listed_flags(page)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(listed) == set(sub.choices) and len(listed) >= 12
    for name, command in sub.choices.items():
        assert listed[name] == accepted_flags(command), name
    assert {"--merge_lora"} <= listed["export"] and "--reward_fn" in listed["eval"]
    assert "--compare" in listed["infer"] and "--compare" in listed["bench"] and "--ulysses_num_heads" in listed["train"]
    # a command that takes the training flags links to them rather than repeating them
    assert page.count('class="cli-flag">--lora_rank<') == 1 and "Takes every flag of [`fastdpo train`](#train)" in page


def test_flags_are_grouped_by_section_in_help_and_on_the_page(capsys):
    sections = config_sections(TrainConfig)
    for title in ("Model", "LoRA and QLoRA", "Data", "Optimizer and schedule", "Loss", "Reference model",
                  "Batching and memory", "Parallelism", "Output and checkpoints", "Logging and monitoring"):
        assert title in sections, title
    assert "lora_rank" in [f.name for f in sections["LoRA and QLoRA"]]
    assert "sequence_parallel_size" in [f.name for f in sections["Parallelism"]]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    out = capsys.readouterr().out
    lora, loss = out.index("\nLoRA and QLoRA:\n"), out.index("\nLoss:\n")
    assert out.index("\n  --lora_rank") in range(lora, loss) and out.index("\n  --beta ") > loss
    page = hook().render()
    assert "### LoRA and QLoRA {#train-lora-and-qlora}" in page and "### Model and output {#export-model-and-output}" in page


def test_every_flag_belongs_to_a_named_section():
    """A flag declared outside a section would land in a catch-all "Options" group; two sections of one config under
    one name would make a nested YAML key ambiguous."""
    for cls in (TrainConfig, EvalConfig, InferConfig, ExportConfig):
        sections = config_sections(cls)
        assert "Options" not in sections, (cls.__name__, [f.name for f in sections.get("Options", [])])
        named = section_names(cls)
        assert sum(len(v) for v in named.values()) == len(dataclasses.fields(cls)), cls.__name__
    assert set(section_names(TrainConfig)) == {"model", "lora", "data", "batching", "optimizer", "loss", "reference",
                                               "evaluation", "output", "hub", "run", "profiling", "monitoring",
                                               "parallel"}


# the page loads this after the theme: it reports each flag name that the browser laid out on more than one line
# (an inline element broken across lines has several client rects) or past the right edge of its column
MEASURE = """<script>
window.addEventListener("load", () => {
  const els = [...document.querySelectorAll(".cli-flag, .cli-word")];
  const broken = els.filter(e => {
    const rects = e.getClientRects();
    const box = e.closest("dt, td, p, li, dd") || e.parentElement;
    return rects.length > 1 || e.getBoundingClientRect().right > box.getBoundingClientRect().right + 1;
  }).map(e => e.textContent);
  const flags = document.querySelectorAll(".cli-flag").length;
  document.body.insertAdjacentHTML("beforeend",
    `<pre id="cli-check">${JSON.stringify({flags, words: els.length, broken, width: window.innerWidth})}</pre>`);
});
</script>"""


@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (apt-get install -y chromium)")
@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="mkdocs is not installed (pip install -e .[docs])")
def test_flag_names_never_break_at_1280px_in_chromium(tmp_path):
    site = tmp_path / "site"
    build = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(site)], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    page = site / "reference/cli/index.html"
    text = page.read_text(encoding="utf-8")
    expected = text.count('class="cli-flag"')
    page.write_text(text.replace("</body>", MEASURE + "</body>"), encoding="utf-8")
    dom = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                          "--window-size=1280,800", "--virtual-time-budget=10000", "--dump-dom", page.as_uri()],
                         capture_output=True, text=True, timeout=120)
    found = re.search(r'<pre id="cli-check">(\{".*?)</pre>', dom.stdout)  # the report, not the script's template
    assert found, (dom.stdout[-2000:], dom.stderr[-2000:])
    result = json.loads(html.unescape(found.group(1)))
    assert result["width"] == 1280 and result["flags"] == expected > 300, result
    assert result["broken"] == [], result["broken"]
