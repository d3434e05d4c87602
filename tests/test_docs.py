"""The pages cannot go stale silently: every repository path and ``tests/...::test_name`` a page names exists, every
page is linked from the README, the README stays a front door (at most 150 lines), and each of its code blocks is
run by a test or by ``.ci/run`` (``<!-- run: WHERE -->`` before it), or says why not (``<!-- not run: WHY -->``)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from harness import ROOT, run_checked, worker_env

README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
# A repository path: one of the top-level folders, then path characters (no placeholders such as <id>).
PATH = re.compile(r"(?<![\w./<>-])((?:strategy|models|conf|scripts|tests|docs|\.ci)/[\w./-]*[\w/])(?:::(\w+))?")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
MARKER = re.compile(r"<!-- (run|not run): (.+?) -->\s*$")


def named_paths(text: str) -> list[tuple[str, str | None]]:
    return [(m[1].rstrip("."), m[2]) for m in PATH.finditer(text)]


def _missing(text: str) -> list[str]:
    missing = []
    for path, test in named_paths(text):
        target = ROOT / path
        if not target.exists():
            missing.append(path)
        elif test and not re.search(rf"^\s*def {test}\(", target.read_text(), re.M):
            missing.append(f"{path}::{test}")
    return missing


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_path_a_page_names_exists(page: Path) -> None:
    missing = _missing(page.read_text())
    assert not missing, f"{page.relative_to(ROOT)} names what does not exist: {sorted(set(missing))}"


def test_the_path_check_can_fail() -> None:
    assert _missing("see `tests/test_gone.py` and tests/test_docs.py::test_nobody_wrote") == [
        "tests/test_gone.py",
        "tests/test_docs.py::test_nobody_wrote",
    ]
    assert _missing("`tests/test_docs.py::test_every_path_a_page_names_exists`, `conf/strategy/fsdp.yaml`") == []


def test_every_page_is_linked_from_the_readme() -> None:
    linked = set(re.findall(r"\]\((docs/[\w.-]+\.md)(?:#[\w-]+)?\)", README.read_text()))
    pages = {str(p.relative_to(ROOT)) for p in PAGES[1:]}
    assert pages <= linked, f"not linked from README.md: {sorted(pages - linked)}"


def test_readme_is_a_front_door() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 150
    for dev_note in ("budget", "lent", "CI at", "commit", "lies on disk", "40m", "minutes on 2 cores"):
        assert dev_note not in text, dev_note  # development notes live in docs/development.md


def readme_blocks() -> list[tuple[str, str, str, str]]:
    """(kind of marker, where or why, language, code) of each fenced block in README.md."""
    text = README.read_text()
    blocks = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").splitlines()
        marker = MARKER.search(before[-1]) if before else None
        assert marker, f"README block without a run/not run marker: {match[2][:80]!r}"
        blocks.append((marker[1], marker[2], match[1], match[2]))
    return blocks


def _normal(command: str) -> str:
    return re.sub(r"\s+", " ", command.replace(" -q", "").replace(" -p no:cacheprovider", "")).strip()


def test_every_readme_block_is_run_where_its_marker_says() -> None:
    ci = _normal((ROOT / ".ci" / "run").read_text())
    for kind, where, language, code in readme_blocks():
        if kind == "not run":
            continue
        target = where.split()[0]
        if target == ".ci/run":  # every command of the block is what .ci/run runs (or a test runs it)
            commands = [c for line in code.splitlines() if not line.startswith("#") for c in line.split("&&")]
            for command in filter(None, map(_normal, commands)):
                runs = {"python scripts/train.py": ROOT / "tests" / "job" / "test_quiet_run.py"}
                if command in runs:
                    assert "scripts/train.py" in runs[command].read_text()
                else:
                    assert command in ci, f"README runs {command!r}, .ci/run does not"
            continue
        assert not _missing(target), f"README marker names {target}, which does not exist"
        if language == "yaml":  # the Hydra tree: the very file the install test's project uses
            project = ROOT / "tests" / "install_project" / "hydra_project" / "config.yaml"
            assert code == project.read_text()


@pytest.mark.slow
def test_readme_python_block_trains(tmp_path: Path) -> None:
    """The README's "use it in your Lightning project" block, as a user's script: dp2 x tp2 on 4 CPU processes."""
    (code,) = [code for _, where, language, code in readme_blocks() if language == "python" and "test_readme" in where]
    script = tmp_path / "train_mine.py"
    script.write_text(code)
    out = run_checked([sys.executable, str(script)], timeout=300, env=worker_env(), cwd=tmp_path)
    assert "dp_shard=2 x tp=2" in out and "`Trainer.fit` stopped: `max_steps=5` reached" in out, out[-3000:]
