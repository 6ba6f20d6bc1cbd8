"""Turn `cargo xtask check --json` output over the peers' case files into the markdown table of
docs/peers.md. Standard library only.

    cargo xtask check DIR/*.safetensors --json > check.json
    python3 python/examples/peers_table.py check.json > table.md
"""

import json
import os
import sys

OUTPUTS = ["O", "LSE", "dQ", "dK", "dV"]


def cell(output):
    if output is None:
        return "—"
    status = output["status"]
    if status == "not verified":
        return "n/v"
    ratio = output.get("max_error_over_bound")
    text = f"{float(ratio):.2g}" if isinstance(ratio, (int, float)) else str(ratio)
    return text if status == "pass" else f"**FAIL {text}**"


def main():
    reports = json.load(open(sys.argv[1]))
    print("| peer | case | expected | verdict | " + " | ".join(OUTPUTS) + " | cause named / note |")
    print("| --- | --- | --- | --- | " + " | ".join("---" for _ in OUTPUTS) + " | --- |")
    for r in sorted(reports, key=lambda r: os.path.basename(r["path"])):
        name = os.path.basename(r["path"]).removesuffix(".safetensors")
        peer, _, case = name.partition("__")
        expected = "fail" if "__WRONG_" in name else "pass"
        if r["status"] == "error":
            print(f"| {peer} | {case} | {expected} | unreadable | " + " | ".join("—" for _ in OUTPUTS) + f" | {r['error']} |")
            continue
        by_name = {o["output"]: o for o in r["outputs"]}
        causes = sorted({o["cause"] for o in r["outputs"] if o.get("cause")})
        notes = [o["output"] + ": " + o["reason"] for o in r["outputs"] if o["status"] == "not verified"]
        regions = [o["output"] + ": failing rectangles " + str(len(o["regions"])) for o in r["outputs"]
                   if o["status"] == "fail" and not o.get("cause")]
        verdict = r["status"]
        # A case none of whose outputs the model could bound has passed nothing: say so instead of "pass".
        if verdict == "pass" and all(o["status"] == "not verified" for o in r["outputs"]):
            verdict = "not verified"
        ok = "✓" if verdict == expected else ("—" if verdict == "not verified" else "✗")
        print(f"| {peer} | {case} | {expected} | {verdict} {ok} | "
              + " | ".join(cell(by_name.get(o)) for o in OUTPUTS)
              + " | " + "; ".join(causes + regions + notes).replace("|", "\\|") + " |")


if __name__ == "__main__":
    main()
