"""The README stays short and links every page of docs/; each page documents what the code has: docs/configuration.md
every config key, docs/metrics.md every metric the learner writes, docs/benchmarks.md and the README's headline
figures what tests/bench/results.json says; docs/DESIGN.md has every section the code cites; links resolve; a run
is started one way in the docs."""

import glob
import os
import re

import msgspec

from common import config
from tests.helpers.paths import REPO

DOCS = os.path.join(REPO, "docs")
README_LINES_MAX = 260


def _read(*parts: str) -> str:
    with open(os.path.join(REPO, *parts)) as f:
        return f.read()


def _pages() -> dict[str, str]:
    """docs/NAME.md -> text, for every markdown page directly under docs/ (reports in its sub-folders excluded)."""
    return {os.path.relpath(p, REPO): open(p).read() for p in sorted(glob.glob(os.path.join(DOCS, "*.md")))}


def _leaves(prefix, obj):
    for name in obj.__struct_fields__:
        value = getattr(obj, name)
        if isinstance(value, msgspec.Struct):
            yield from _leaves(f"{prefix}{name}.", value)
        else:
            yield f"{prefix}{name}"


def test_every_config_key_is_documented():
    text = _read("docs", "configuration.md")
    keys = list(_leaves("", config.Config()))
    for loss in (config.ClipCovLoss(), config.KLCovLoss(), config.GSPOLoss(), config.CISPOLoss()):
        keys += [f"learner.loss.{k}" for k in loss.__struct_fields__]
    missing = [k for k in keys if f"`{k}`" not in text and f"`{k.rsplit('.', 1)[1]}`" not in text]
    assert not missing, f"docs/configuration.md lacks config keys: {missing}"


def test_every_learner_metric_is_documented():
    text = _read("docs", "metrics.md")
    src = _read("learner", "trainer.py") + _read("learner", "loop.py")
    metrics = set(re.findall(r'"((?:actor|critic|perf|timing_s|staleness|filter|weights|learner|reward|response_length)/[a-z_/]+)"', src))
    assert len(metrics) > 20
    missing = sorted(m for m in metrics if m not in text)
    assert not missing, f"docs/metrics.md lacks metrics: {missing}"
    # The composed names: the off-policy profile's (a quintile family documented by its first member) and the
    # staleness histogram's bins.
    import numpy as np
    import torch

    from learner import loop, offpolicy
    from learner.tokens import Choices, Seen, Surveyed
    from tests.helpers.collectives import OneRank

    one = torch.ones(1, 1)
    entry = Surveyed(old=0 * one, entropy=one, adv=one, mask=one, behav=0 * one, seq_ids=torch.zeros(1, 1).long(),
                     num_seqs=1)
    seen = Seen(start=entry, choices=Choices(), clipped=0 * one, masked=0 * one)
    names = [f"offpolicy/{k}" for k in offpolicy.offpolicy_profile([seen], OneRank())] + ["offpolicy/ess_lr_scale"]
    names = [re.sub(r"_q\d$", "_q1", n) for n in names]
    bins = [k.removeprefix("staleness/share_lag") for k in loop.staleness_shares(np.zeros(1))]
    missing = sorted(n for n in names if f"`{n}`" not in text) + sorted(b for b in bins if f"`{b}`" not in text
                                                                      and f"`staleness/share_lag{b}`" not in text)
    assert len(names) > 10 and len(bins) == 8 and not missing, f"docs/metrics.md lacks metrics: {missing}"


def test_benchmark_table_and_headline_match_results_json():
    """docs/benchmarks.md's table and the README's headline figures are what tests/bench/results.json says (make
    bench renders both)."""
    import json

    from tests.bench.readme_table import RESULTS, block, headline_block

    with open(RESULTS) as f:
        res = json.load(f)
    fix = "run `python tests/bench/readme_table.py --write`"
    assert block(res) in _read("docs", "benchmarks.md"), f"docs/benchmarks.md's table is stale: {fix}"
    assert headline_block(res) in _read("README.md"), f"the README's headline figures are stale: {fix}"
    verdicts = {k: v["verdict"] for k, v in res.items() if isinstance(v, dict) and "verdict" in v}
    assert len(verdicts) == 13, sorted(verdicts)  # all twelve benchmarks (6 has two parts)


def test_readme_results_are_figures_of_the_docs():
    """Every number the README's Results section states by hand (outside the rendered headline) is one its docs
    pages state too, so a figure changed there cannot stay behind in the README."""
    readme = _read("README.md")
    results = readme[readme.index("## Results"):readme.index("\n## ", readme.index("## Results") + 1)]
    results = re.sub(r"<!-- bench-headline:begin -->.*<!-- bench-headline:end -->", "", results, flags=re.S)
    results = re.sub(r"\]\([^)]*\)", "]", results)  # link targets are checked by the link test
    number = r"\d[\d,]*(?:\.\d+)?"
    numbers = set(re.findall(number, results))
    assert len(numbers) > 10, numbers
    missing = sorted(numbers - set(re.findall(number, "".join(_pages().values()))))
    assert not missing, f"the README's Results section states figures no docs page has: {missing}"


def test_readme_is_short():
    lines = _read("README.md").count("\n")
    assert lines < README_LINES_MAX, (f"README.md has {lines} lines; keep it under {README_LINES_MAX} and move "
                                      "detail into a page of docs/")


def test_readme_links_every_docs_page_and_each_exists():
    readme = _read("README.md")
    linked = {os.path.normpath(t) for t in re.findall(r"\]\((docs/[^)#\s]+\.md)(?:#[^)]*)?\)", readme)}
    missing = sorted(t for t in linked if not os.path.isfile(os.path.join(REPO, t)))
    assert not missing, f"the README links docs pages that do not exist: {missing}"
    unlinked = sorted(set(_pages()) - linked)
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


def _anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    heads = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", text, flags=re.S), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for page, text in {"README.md": _read("README.md"), **_pages()}.items():
        here = os.path.dirname(os.path.join(REPO, page))
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", re.sub(r"```.*?```", "", text, flags=re.S)):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path = os.path.normpath(os.path.join(here, target)) if target else os.path.join(REPO, page)
            if not os.path.exists(path):
                broken.append(f"{page}: {target}")
            elif anchor and path.endswith(".md") and anchor not in _anchors(open(path).read()):
                broken.append(f"{page}: {target}#{anchor}")
    assert not broken, f"broken links: {broken}"


def test_runs_are_started_one_way_in_the_docs():
    """`covrl run` is the documented way to start a run: no page shows another form with flags (one sentence may
    name them as still working)."""
    other = re.compile(r"(covrl-cluster|python3? (?:-m launch\.cluster|launch/cluster\.py))\s+--")
    pages = {"README.md": _read("README.md"), **_pages()}
    found = [f"{page}: {m.group(0)}" for page, text in pages.items() for m in other.finditer(text)]
    assert not found, f"start runs with `covrl run ...` instead of: {found}"


def test_every_design_reference_resolves():
    """Code, tests and the docs cite `docs/DESIGN.md section N`: the document is in the repository and has each
    section N that is cited."""
    design = os.path.join(REPO, "docs", "DESIGN.md")
    assert os.path.isfile(design), "docs/DESIGN.md is cited but missing"
    sections = set(re.findall(r"^## (\d+)\.", open(design).read(), flags=re.M))
    cited = {}
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("runs", "__pycache__")]
        for f in files:
            if f.endswith((".py", ".md")) and f != "DESIGN.md":
                path = os.path.join(root, f)
                for n in re.findall(r"docs/DESIGN\.md section (\d+)", open(path, errors="replace").read()):
                    cited.setdefault(n, []).append(os.path.relpath(path, REPO))
    assert cited, "no citation found: the walk is broken"
    missing = {n: where for n, where in cited.items() if n not in sections}
    assert not missing, f"docs/DESIGN.md lacks the cited sections: {missing}"
