"""Summarise a py-spy speedscope profile: per thread, the functions with the most samples (inclusive, self).

    .venv/bin/python -m bench.spy_summary PROFILE.speedscope.json [--top N] [--match roomservice]
"""

from __future__ import annotations

import argparse
import collections
import json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("profile")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--match", default="", help="only frames whose file contains this")
    args = parser.parse_args()
    with open(args.profile) as f:
        data = json.load(f)
    frames = data["shared"]["frames"]

    def name(i: int) -> str:
        frame = frames[i]
        where = frame.get("file", "").split("site-packages/")[-1].split("src/")[-1]
        return f"{frame['name']} ({where}:{frame.get('line', '')})"

    everything = sum(len(p["samples"]) for p in data["profiles"])
    for profile in data["profiles"]:
        samples = profile["samples"]
        if len(samples) < max(20, everything // 50):
            continue
        inclusive: collections.Counter[int] = collections.Counter()
        own: collections.Counter[int] = collections.Counter()
        for stack in samples:
            if stack:
                own[stack[-1]] += 1
            inclusive.update(set(stack))
        print(f"=== {profile['name']}: {len(samples)} samples ({100 * len(samples) / everything:.0f} % of all)")
        for title, counter in (("inclusive", inclusive), ("self", own)):
            print(f"-- {title}")
            shown = 0
            for frame, n in counter.most_common():
                if args.match and args.match not in frames[frame].get("file", ""):
                    continue
                print(f"{100 * n / len(samples):5.1f}%  {name(frame)}")
                shown += 1
                if shown >= args.top:
                    break


if __name__ == "__main__":
    main()
