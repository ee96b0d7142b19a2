"""A run's records of its roles, read and checked: Ray placements and each generator's received weight versions."""

from __future__ import annotations

import json


def placements(run) -> list[dict]:
    """RUN_DIR/placement.jsonl's entries, one per start of a role on Ray ([] before the first)."""
    path = run / "placement.jsonl"
    return [json.loads(line) for line in open(path)] if path.exists() else []


def weight_log(run, gen_id: int) -> dict[str, list[dict]]:
    """Generator `gen_id`'s received versions, per incarnation (its weight channel's prefix)."""
    by_channel: dict[str, list[dict]] = {}
    with open(run / "generators" / f"gen{gen_id}.jsonl") as f:
        for line in f:
            e = json.loads(line)
            by_channel.setdefault(e["channel"], []).append(e)
    return by_channel


def check_weights_followed(run, rows: list[dict], gen_ids) -> None:
    """Each generator, each incarnation: sent the latest version when it joined, then every later one in order, each
    with the learner's checksum."""
    learner_sums = {int(r["weights/version"]): r["weights/checksum"] for r in rows}
    for g in gen_ids:
        for channel, got in weight_log(run, g).items():
            versions = [e["version"] for e in got]
            assert versions == list(range(versions[0], versions[-1] + 1)), (g, channel, versions)
            assert all(e["checksum"] == learner_sums[e["version"]] for e in got), (g, channel)
