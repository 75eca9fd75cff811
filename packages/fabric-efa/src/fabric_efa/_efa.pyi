"""Stubs of the compiled module (checked against it with stubtest)."""

import numpy as np
import numpy.typing as npt

class LibfabricError(RuntimeError): ...

def probe(provider: str) -> str | None: ...
def libfabric_version() -> tuple[int, int]: ...
def close_address(address: bytes) -> None: ...
def reopen_address(address: bytes) -> None: ...
def is_closed(address: bytes) -> bool: ...

class Engine:
    def __init__(
        self, provider: str, nics: int, chaos_seed: int | None, cpu: int, recv_depth: int, max_send: int
    ) -> None: ...
    def addresses(self) -> list[bytes]: ...
    def provider_info(self) -> dict[str, object]: ...
    def register_memory(self, ptr: int, length: int, remote_write: bool) -> tuple[int, list[int]]: ...
    def deregister(self, handle: int) -> None: ...
    def submit_write(
        self,
        id: int,
        src_handle: int,
        src_base: int,
        nic: npt.NDArray[np.int64],
        target: npt.NDArray[np.int64],
        src_off: npt.NDArray[np.int64],
        dst_off: npt.NDArray[np.int64],
        length: npt.NDArray[np.int64],
        imm: int,
        targets: list[tuple[list[bytes], list[int], int]],
    ) -> None: ...
    def configure_fast(
        self,
        max_msg: int,
        sharded: object,
        pinned: object,
        shard_peers: object,
        descriptor: object,
        guarded: bool,
    ) -> None: ...
    def bind_region(self, token: int, region_handle: int, region: object) -> None: ...
    def fast_write(
        self,
        id: int,
        src: object,
        src_offset: object,
        length: object,
        dst: object,
        dst_offset: object,
        imm: object,
        routing: object,
    ) -> int: ...
    def fast_paged(
        self,
        id: int,
        src: object,
        src_pages: object,
        src_stride: object,
        dst: object,
        dst_pages: object,
        dst_stride: object,
        page_length: object,
        src_offset: object,
        dst_offset: object,
        imm: object,
        routing: object,
    ) -> int: ...
    def fast_imm(self, id: int, dst: object, imm: object, routing: object) -> int: ...
    def fast_submitted(self) -> int: ...
    def plan_only(
        self, kind: str, args: tuple[object, ...], rotation: int
    ) -> (
        tuple[
            npt.NDArray[np.int64],
            npt.NDArray[np.int64],
            npt.NDArray[np.int64],
            npt.NDArray[np.int64],
            npt.NDArray[np.int64],
        ]
        | None
    ): ...
    def submit_send(self, id: int, address: bytes, payload: bytes) -> None: ...
    def check_peer(self, id: int, address: bytes) -> None: ...
    def wait_batch(
        self, timeout_s: float
    ) -> tuple[list[tuple[int, int, str]], list[tuple[int, int]], list[bytes]]: ...
    def stats(self) -> dict[str, int]: ...
    def close(self) -> None: ...
    def destroy(self) -> None: ...
