"""Paged requests on tcp;ofi_rxm go several pages a write (fabric-efa's lists,
``LibfabricDomain::post_write_list``): one delivery-complete write scatters up to
``efa_list_pages`` pages (the provider's iov limits: 4 on rxm), and its one remote CQ data
carries the imm with the page count in its upper 32 bits, so that the target counts the imm
once per page. These tests hold the contract to it: every page's bytes exactly in place and
nothing else touched, the imm counted exactly once per page whatever the page count, chaos
order included, and a refused key still a ``RemoteAccessError`` that names the key.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import pytest

from fabric_core.errors import RemoteAccessError, TransferTimeout
from fabric_efa.engine import EfaEngine

os.environ.setdefault("FI_TCP_IFACE", "lo")

EngineFactory = Callable[..., EfaEngine]
T = 20.0
TCP = "tcp;ofi_rxm"


def _list_ops(e: EfaEngine) -> int:
    return int(e._core.stats()["list_ops"])


@pytest.mark.parametrize(
    ("list_pages", "pages", "page", "stride", "chaos"),
    [
        (4, 1023, 4096, 4096, None),  # 255 writes of 4 pages and one of 3
        (4, 2, 100, 128, None),  # a request of two small pages: one write
        (3, 10, 512, 1000, 7),  # 3 a write (4, 3, 3: in chaos order), pages not at their stride
        (1, 64, 4096, 4096, None),  # off: a write a page
    ],
)
def test_pages_go_several_a_write_and_each_counts_once(
    efa_engine: EngineFactory, list_pages: int, pages: int, page: int, stride: int, chaos: int | None
) -> None:
    rng = np.random.default_rng(pages)
    extra = {} if chaos is None else {"chaos_seed": chaos}
    with efa_engine(TCP, efa_list_pages=list_pages, **extra) as writer, efa_engine(TCP) as target:
        assert writer.provider_info["list_pages"] == (list_pages if list_pages > 1 else 0)
        slots = pages + 7
        src = rng.integers(1, 256, pages * stride, dtype=np.uint8)
        dst = np.zeros(slots * stride, dtype=np.uint8)
        src_mr, dst_mr = writer.register(src), target.register(dst)
        src_pages = rng.permutation(pages)
        dst_pages = rng.permutation(slots)[:pages]  # scattered, distinct, some slots left alone
        before = _list_ops(writer)
        transfer = writer.submit_paged_write(
            src_mr, src_pages, stride, dst_mr.descriptor, dst_pages, stride, page, imm=11
        )
        assert transfer.imms_at_target == pages
        transfer.wait(T)
        counter = target.counter(11)
        counter.wait(pages, timeout=T)
        with pytest.raises(TransferTimeout):  # exactly once per page: not one count more
            counter.wait(1, timeout=0.2)
        expect = np.zeros_like(dst)
        for s, d in zip(src_pages, dst_pages, strict=True):
            expect[d * stride : d * stride + page] = src[s * stride : s * stride + page]
        assert np.array_equal(dst, expect)  # every page in place, nothing else touched
        per_write = list_pages if list_pages > 1 else 0
        assert _list_ops(writer) - before == (-(-pages // per_write) if per_write else 0)
        writer.deregister(src_mr)
        target.deregister(dst_mr)


def test_lists_are_tcps_alone(efa_engine: EngineFactory) -> None:
    """shm keeps a write a page (its region table checks each write before it is posted, and
    its delivery markers confirm small ones); so does any provider whose remote CQ data has no
    room for the count (efa: 4 bytes)."""
    with efa_engine("shm") as e:
        assert e.provider_info["list_pages"] == 0


def test_a_list_to_a_refused_key_fails_as_remote_access_and_the_engines_go_on(
    efa_engine: EngineFactory,
) -> None:
    """tcp drops the connection of a write to a key its target does not have, without a word;
    the writer asks the target what it has under the key (an access check), for the whole
    span of the list's pages, and fails the request as refused. Nothing is counted."""
    with efa_engine(TCP) as writer, efa_engine(TCP) as target:
        src = np.arange(64 * 1024, dtype=np.uint8)
        dst = np.zeros(64 * 1024, dtype=np.uint8)
        src_mr, dst_mr = writer.register(src), target.register(dst)
        stale = dst_mr.descriptor
        target.deregister(dst_mr)
        with pytest.raises(RemoteAccessError, match="no region") as err:
            writer.submit_paged_write(
                src_mr, np.arange(8), 4096, stale, np.arange(8)[::-1], 4096, 4096, imm=3
            ).wait(T)
        assert err.value.peer == target.address.raw.hex()
        assert target.counter(3).value == 0
        assert not dst.any()
        # and a list to a live region goes through afterwards (the connection is rebuilt)
        fresh = target.register(dst)
        writer.submit_paged_write(
            src_mr, np.arange(8), 4096, fresh.descriptor, np.arange(8)[::-1], 4096, 4096, imm=3
        ).wait(T)
        target.counter(3).wait(8, timeout=T)
        for i in range(8):
            assert np.array_equal(dst[(7 - i) * 4096 : (8 - i) * 4096], src[i * 4096 : (i + 1) * 4096])
        writer.deregister(src_mr)
        target.deregister(fresh)
