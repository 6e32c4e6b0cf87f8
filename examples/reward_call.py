"""A reward-model call on a GPU service (the emulated `reward` service of the local cluster).

The first call restores the service from its host-memory copy onto a GPU (`loaded=True`);
later calls find it resident. Start a cluster, then run this file:

    tangram up
    python examples/reward_call.py      # the client finds the local cluster (or: eval "$(tangram env)")
"""

from __future__ import annotations

import argparse

import tangram


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--addr", default=None, help="submit address (default: $TANGRAM_ADDR)")
    ap.add_argument("--service", default="reward")
    args = ap.parse_args()
    samples = [
        ("the cat sat on the mat", "a cat sat on the mat"),
        ("42", "the answer is 42"),
        ("no idea", "paris"),
    ]
    with tangram.Client(args.addr, name="reward-example") as tg:
        futures = [
            tg.submit(tg.call, args.service, {"response": r, "reference": ref}, gpus=1, timeout=60)
            for r, ref in samples
        ]
        for (response, _), fut in zip(samples, futures, strict=True):
            res = fut.result()
            print(
                f"{response!r:28} score {res.value['score']:.3f}  node {res.node} gpus {list(res.gpus)} "
                f"restored {res.loaded}  run {res.run_s * 1000:.1f}ms  overhead {res.overhead_s * 1000:.1f}ms"
            )


if __name__ == "__main__":
    main()
