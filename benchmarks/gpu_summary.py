"""``run_gpu.sh``'s last step: one results file for the device and a summary table.

    python benchmarks/gpu_summary.py --steps LOG_DIR/steps.tsv --slug SLUG --device cuda --json OUT.json
                                     --summary OUT.md

``--steps``: one line per step the script ran, ``name<TAB>exit status<TAB>seconds<TAB>its JSON`` (empty when it
writes none). The results file holds ``{"device", "slug", "environment", "steps": {name: {"exit", "seconds",
"results"}}}``, ``results`` being the step's own JSON (``write_json``'s payload) or None. The summary table
(Markdown, also printed) gives per step its exit status, seconds, result rows, and how many of them are invalid
measurements (:func:`gaengine.tools.bench.plausible.check_payload`: over the bound their own run measured), then
one line per invalid figure with its likely cause. Exit status 1 when a step exited 0 but its JSON is missing
or unreadable (a step that failed is already reported by the script); invalid figures are listed, not fatal.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from contextlib import redirect_stdout
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, print_table  # noqa: E402

from gaengine.tools.bench.plausible import check_payload  # noqa: E402


def summarize(steps_tsv: Path, slug: str, device: str) -> tuple[dict, list[dict], list[str], list[str]]:
    """The results file's payload, the summary rows, the invalid-figure lines and the missing-JSON lines."""
    payload: dict = {"device": device, "slug": slug, "environment": environment([device]), "steps": {}}
    rows, invalid, missing = [], [], []
    for line in steps_tsv.read_text().splitlines():
        if not line.strip():
            continue
        name, rc, seconds, json_path = (line.split("\t") + [""])[:4]
        results = None
        if json_path:
            try:
                results = json.loads(Path(json_path).read_text())
            except (OSError, ValueError) as exc:
                if rc == "0":
                    missing.append(f"{name}: exited 0 but its results {json_path} cannot be read ({exc})")
        payload["steps"][name] = {"exit": int(rc), "seconds": int(seconds), "results": results}
        bad = check_payload(results) if results else []
        invalid += [f"{name}: {row}: {reason}" for row, reason in bad]
        rows.append({"step": name, "exit": int(rc), "seconds": int(seconds),
                     "rows": len(results.get("results", [])) if results else None,
                     "invalid": len(bad) if results else None})
    return payload, rows, invalid, missing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=Path, required=True)
    parser.add_argument("--slug", required=True)
    parser.add_argument("--device", required=True)
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--summary", type=Path, required=True)
    args = parser.parse_args(argv)
    payload, rows, invalid, missing = summarize(args.steps, args.slug, args.device)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(payload, indent=2) + "\n")
    text = io.StringIO()
    with redirect_stdout(text):
        env = payload["environment"]
        print_table(rows, [("step", "step", "s"), ("exit", "exit", "d"), ("seconds", "s", "d"), ("rows", "rows", "d"),
                           ("invalid", "invalid", "d")],
                    f"run_gpu.sh on {args.slug} ({', '.join(env['devices'].values())}), torch {env['torch']}, "
                    f"git {env['git_sha']}: {sum(r['exit'] != 0 for r in rows)} of {len(rows)} steps failed, "
                    f"{len(invalid)} invalid figure(s)")
        for line in invalid:
            print(f"\n- INVALID MEASUREMENT, not a result: {line}")
        for line in missing:
            print(f"\n- MISSING RESULTS: {line}")
    args.summary.write_text(text.getvalue().lstrip("\n"))
    print(text.getvalue())
    print(f"wrote {args.json} and {args.summary}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
