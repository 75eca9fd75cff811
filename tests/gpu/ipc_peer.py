"""Another process for tests/gpu/test_cuda_ipc.py: an efa shm engine driven line by line.

Commands on stdin, one reply line each on stdout:

    reg cuda|cpu NBYTES SEED     register a tensor (SEED < 0: zeros; else random bytes from
                                 SEED); reply: INDEX DESCRIPTOR_HEX
    write INDEX DESC_HEX LEN IMM submit a write of region INDEX's first LEN bytes; reply
                                 "ok" or the error's class name
    wait IMM COUNT               wait for COUNT imms; reply "ok" or the error's class name
    sha INDEX                    the sha256 of the region's bytes
    count IMM                    the imms counted so far
    dereg INDEX                  deregister; reply "ok"
    exit
"""

from __future__ import annotations

import hashlib
import sys
from typing import Any

import torch

from fabric_core import FabricError, MemoryRegionDescriptor, WriteRequest, open_engine


def _tensor(where: str, n: int, seed: int) -> Any:
    if seed < 0:
        return torch.zeros(n, dtype=torch.uint8, device=where)
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).to(where)


def main() -> None:
    e = open_engine("efa", efa_provider="shm")
    print(f"ready {e.domains[0].details['cuda_memory']}", flush=True)
    tensors: list[Any] = []
    regions: list[Any] = []
    for line in sys.stdin:
        cmd, *args = line.split()
        reply = "ok"
        try:
            if cmd == "reg":
                t = _tensor(args[0], int(args[1]), int(args[2]))
                tensors.append(t)
                regions.append(e.register(t))
                reply = f"{len(regions) - 1} {regions[-1].descriptor.to_bytes().hex()}"
            elif cmd == "write":
                desc = MemoryRegionDescriptor.from_bytes(bytes.fromhex(args[1]))
                r = regions[int(args[0])]
                e.submit(WriteRequest(r, 0, int(args[2]), desc, 0, imm=int(args[3]))).wait(timeout=30)
            elif cmd == "wait":
                e.counter(int(args[0])).wait(int(args[1]), timeout=30)
            elif cmd == "sha":
                torch.cuda.synchronize()
                reply = hashlib.sha256(tensors[int(args[0])].cpu().numpy().tobytes()).hexdigest()
            elif cmd == "count":
                reply = str(e.counter(int(args[0])).value)
            elif cmd == "dereg":
                e.deregister(regions[int(args[0])])
            elif cmd == "exit":
                break
        except FabricError as exc:
            reply = type(exc).__name__
        print(reply, flush=True)
    e.close()


if __name__ == "__main__":
    main()
