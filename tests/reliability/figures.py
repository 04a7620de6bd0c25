"""Print the figures a reliability run recorded as Markdown tables (for docs/RELIABILITY.md).

GROUPCOORD_RELIABILITY_REPORT=/tmp/rel.jsonl pytest tests/reliability
python tests/reliability/figures.py /tmp/rel.jsonl
"""

from __future__ import annotations

import json
import sys


def main(path: str) -> None:
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    kills = [r for r in rows if r["case"].startswith("kill:")]
    print("| case | mode | trials | worst detection (s) | median (s) | over 5 s | left behind |")
    print("|---|---|---|---|---|---|---|")
    for r in kills:
        print(
            f"| {r['case'][6:]} | {r['mode']} | {r['trials']} | {r['worst_detect_s']} | "
            f"{r.get('median_detect_s', '')} | {r.get('over_limit', '')} | {r['left_behind']} |"
        )
    timeouts = [r for r in rows if r["case"].startswith("timeout:")]
    if timeouts:
        wrong = [r for r in timeouts if r["raised"] != "GroupcoordTimeoutError"]
        worst = max(r["seconds"] for r in timeouts)
        print(f"\ntimeout table: {len(timeouts)} calls, slowest {worst} s, wrong type: ", end="")
        print(", ".join(f"{r['case'][9:]} ({r['raised']})" for r in wrong) or "none")
    bad = [r for r in rows if r["case"].startswith("bad input:")]
    if bad:
        print(f"bad input: {len(bad)} calls; raised: ", end="")
        kinds: dict[str, int] = {}
        for r in bad:
            kinds[r["raised"]] = kinds.get(r["raised"], 0) + 1
        print(", ".join(f"{k} x{v}" for k, v in sorted(kinds.items())))
    for r in rows:
        if r["case"].startswith(("hostile", "soak", "small")):
            rest = {k: v for k, v in r.items() if k not in ("case", "mode")}
            print(f"- {r['case']} ({r['mode']}): {json.dumps(rest)[:400]}")


if __name__ == "__main__":
    main(sys.argv[1])
