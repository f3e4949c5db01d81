"""Wake-up latency of the reward timeout's wait (it once slowed the demo).

The time from a reward function's return (in its isolation thread) to the return of the
combined call, median of 30 calls, for a function that works ~10 ms (busy loop, like the
demo's arithmetic verifier on 1024 completions). Run it against any checkout:

    PYTHONPATH=/path/to/checkout python bench/reward_wait.py NAME

With the 50 ms poll (commits before 4d391dd) the median latency was ~50 ms; waiting on the
call's own event it is ~0.2 ms.
"""
import inspect
import statistics
import sys
import time

from rljax import rewards

starts, ends = [], []


def busy_10ms(prompts, completions, **_):
    starts.append(time.perf_counter())
    while time.perf_counter() - starts[-1] < 0.010:
        pass
    ends.append(time.perf_counter())
    return [1.0] * len(completions)


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "this tree"
    kw = {"timeout_s": 30.0} if "timeout_s" in inspect.signature(rewards.combine).parameters else {}
    comb = rewards.combine([(busy_10ms, 1.0)], **kw)
    latency, own = [], []
    for _ in range(30):
        comb(["q"] * 8, ["a"] * 8)
        done = time.perf_counter()
        latency.append(done - ends[-1])
        own.append(ends[-1] - starts[-1])
    print(f"{name}: wake-up latency median {statistics.median(latency) * 1e3:.2f} ms "
          f"(max {max(latency) * 1e3:.2f}); the function itself {statistics.median(own) * 1e3:.1f} ms "
          f"wall; load average {open('/proc/loadavg').read().split()[0]}")


if __name__ == "__main__":
    main()
