"""tests/distributed/test_warm.py's worker: writes its rank's torchrun variables and a
torch.distributed all-reduce; `--fail_rank R` exits 3 on rank R while the others wait on a
collective it never joins."""
import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--out_dir")
parser.add_argument("--fail_rank", type=int, default=-1)
a = parser.parse_args()
rank = int(os.environ["RANK"])
if rank == a.fail_rank:
    sys.exit(3)
dist.init_process_group("gloo")
total = torch.tensor([float(rank + 1)])
dist.all_reduce(total)
names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
with open(os.path.join(a.out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(dict({n: os.environ[n] for n in names}, total=total.item()), f)
dist.destroy_process_group()
