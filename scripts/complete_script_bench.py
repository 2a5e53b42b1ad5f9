#!/usr/bin/env python3
"""Server time per call of the Redis store's completion script, this checkout's against the one
before `COMPLETE_LUA` took the record whole (commit 2879e9b), side by side.

    python3 -m pip install redis==5.2.1          # the client this script uses
    python3 scripts/complete_script_bench.py      # REDIS_URL, N, ROUNDS and OUTCOME_BYTES to change

For each path through the script it runs N completions with the one script, then N with the
other (their order swapped every round), each on an emptied database 14, and reads Redis's own
`INFO commandstats` (`usec_per_call` of `evalsha`: the time the server spent in the command,
without reading or writing the connection). Paths: `claimed` (the key holds this call's claim, a
completion's usual case), `gone` (the key expired), `other_fp` (the key holds a claim of this
token with another fingerprint, which only a direct caller of the `Store` trait can make) and
`retried` (the key holds this token's record: a completion sent again after a lost reply) and
`contested` (another token's claim holds the key: the script refuses and writes nothing). Each
round checks the record both scripts leave, and the table gives each path's median time and the
median of the per-round ratios. The load average is printed at the start and the end.
"""

import os
import re
import statistics
import subprocess
import sys

import redis

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "..", "idempotent-runtime", "src", "stores", "redis", "mod.rs")


def script_of(text):
    match = re.search(r'const COMPLETE_LUA: &str = r"(.*?)";', text, re.S)
    if not match:
        sys.exit("COMPLETE_LUA not found")
    return match.group(1)


def main():
    url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379")
    n = int(os.environ.get("N", "20000"))
    rounds = int(os.environ.get("ROUNDS", "6"))
    outcome = b'{"Ok":"' + b"x" * max(0, int(os.environ.get("OUTCOME_BYTES", "42")) - 9) + b'"}'
    r = redis.Redis.from_url(url, db=14)
    before = subprocess.run(
        ["git", "-C", HERE, "show", "2879e9b:idempotent-runtime/src/stores/redis/mod.rs"],
        check=True, capture_output=True, text=True,
    ).stdout
    scripts = {"before": r.script_load(script_of(before)), "now": r.script_load(script_of(open(SOURCE).read()))}
    token, fp = b"0123456789abcdef0123456789abcdef", b"f" * 64
    running, done = b"idempotent/1 running " + token + b" ", b"idempotent/1 done " + token + b" "
    claim, header = running + fp + b"\n", done + fp + b"\n"
    # Each script's arguments, as its version of `complete_now` sends them.
    args = {
        "before": (running, done, outcome, 600000, header, 0),
        "now": (claim, header + outcome, 600000, 0),
    }
    theirs = b"idempotent/1 running " + b"9" * 32 + b" " + fp + b"\n"
    stored = {
        "claimed": claim,
        "gone": None,
        "other_fp": running + b"-\n",
        "retried": header + outcome,
        "contested": theirs,
    }
    expected = {
        "claimed": header + outcome,
        "gone": header + outcome,
        "other_fp": done + b"-\n" + outcome,
        "retried": header + outcome,
        "contested": theirs,
    }
    # The script's reply: 1 recorded (or recorded before by this token), 0 another token's key.
    replied = {path: 0 if path == "contested" else 1 for path in stored}

    def run(which, path):
        r.flushdb()
        r.config_resetstat()
        pipe = r.pipeline(transaction=False)
        for i in range(n):
            key = b"k:%d" % i
            if stored[path] is not None:
                pipe.set(key, stored[path], nx=True, px=600000)
            pipe.evalsha(scripts[which], 1, key, *args[which])
            if i % 500 == 499 or i == n - 1:
                replies = pipe.execute()
                scripts_replies = replies if stored[path] is None else replies[1::2]
                assert all(reply == replied[path] for reply in scripts_replies), replies[:4]
                pipe = r.pipeline(transaction=False)
        assert r.get(b"k:0") == expected[path], (which, path, r.get(b"k:0"))
        stats = r.info("commandstats")["cmdstat_evalsha"]
        assert stats["calls"] == n
        return stats["usec_per_call"]

    print("load average at the start:", open("/proc/loadavg").read().split()[:3])
    times = {}
    for number in range(rounds):
        for path in stored:
            for which in ("before", "now") if number % 2 == 0 else ("now", "before"):
                times.setdefault((path, which), []).append(run(which, path))
    r.flushdb()
    print(f"{n} completions per script, path and round; {rounds} rounds; outcome {len(outcome)} bytes")
    print("| path | before, µs per call | now | now / before, per round | median |")
    print("|---|---:|---:|---|---:|")
    for path in stored:
        old, new = times[(path, "before")], times[(path, "now")]
        ratios = [b / a for a, b in zip(old, new)]
        print(
            f"| {path} | {statistics.median(old):.2f} | {statistics.median(new):.2f} | "
            f"{', '.join(f'{x:.2f}' for x in ratios)} | {statistics.median(ratios):.3f} |"
        )
    print("load average at the end:", open("/proc/loadavg").read().split()[:3])


if __name__ == "__main__":
    main()
