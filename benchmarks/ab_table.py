"""Two builds alternated (`tandem bench` runs named old_<set>_r<N>.json and new_<set>_r<N>.json in
one folder): per prompt and mode the fastest round of each build (the one least disturbed by the
host), then the median over prompts of after / before time per token. On a shared VM runs of one
build differ by 10% from minute to minute; a prompt's best of several alternated rounds does not.

    python benchmarks/ab_table.py docs/results/house/fine
"""

import glob
import json
import re
import statistics
import sys
from collections import defaultdict


def main(folder: str) -> None:
    best: dict[str, dict] = defaultdict(dict)  # build -> (set, mode, prompt) -> least seconds per token
    for path in glob.glob(f"{folder}/*_r*.json"):
        side, dataset = re.search(r"(old|new)_(\w+?)_r\d+\.json$", path).groups()
        for prompt in json.load(open(path))["prompts"]:
            for mode, m in prompt["modes"].items():
                key = (dataset, mode, prompt["id"])
                best[side][key] = min(best[side].get(key, float("inf")), m["seconds"] / m["tokens"])
    ratios = defaultdict(list)
    for key, seconds in best["new"].items():
        ratios[key[:2]].append(seconds / best["old"][key])
    print("| set | mode | after / before, time per token | prompts |")
    print("|---|---|---:|---:|")
    for (dataset, mode), r in sorted(ratios.items()):
        print(f"| {dataset} | {mode} | {statistics.median(r):.3f} | {len(r)} |")


if __name__ == "__main__":
    main(sys.argv[1])
