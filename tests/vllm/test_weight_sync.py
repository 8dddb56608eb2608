"""Weight-sync pieces that need no engine: bucketing of the export stream (sizes, oversized
tensors, the `last` mark) and the flat wire format (pack/unpack round trip across dtypes, with
aligned offsets), and the CPU communicator's addresses (store and gloo connections on the
server's host only)."""
import pytest
import torch

from swift_megatron.rollout.weight_sync import (ALIGN, iter_buckets, layout, pack, spec_of,
                                                unpack)


def named(*sizes, dtype=torch.float32):
    return [(f"t{i}", torch.arange(n, dtype=dtype)) for i, n in enumerate(sizes)]


def test_buckets_respect_the_size_and_mark_the_last():
    tensors = named(10, 10, 10, 100, 5)                       # float32: 40, 40, 40, 400, 20 bytes
    buckets = list(iter_buckets(iter(tensors), bucket_bytes=80))
    assert [[n for n, _ in b] for b, _ in buckets] == [["t0", "t1"], ["t2"], ["t3"], ["t4"]]
    assert [last for _, last in buckets] == [False, False, False, True]


def test_one_bucket_and_no_tensors():
    assert [(len(b), last) for b, last in iter_buckets(iter(named(1, 2)), 1 << 20)] == [(2, True)]
    assert list(iter_buckets(iter([]), 100)) == []


def test_pack_unpack_round_trip_mixed_dtypes():
    bucket = [("a", torch.randn(3, 5)), ("b", torch.randn(7).to(torch.bfloat16)),
              ("c", torch.arange(6, dtype=torch.int64).reshape(2, 3)),
              ("d", torch.randn(1, 1, 3).half())]
    specs, flat = pack(bucket, torch.device("cpu"))
    offsets, total = layout(specs)
    assert flat.dtype == torch.uint8 and flat.numel() == total
    assert all(o % ALIGN == 0 for o in offsets)
    for (name, tensor), (got_name, got) in zip(bucket, unpack(specs, flat.clone())):
        assert got_name == name and got.dtype == tensor.dtype and torch.equal(got, tensor)
    spec = spec_of("x", torch.zeros(2, 3, dtype=torch.bfloat16))
    assert (spec.name, spec.dtype, spec.shape, spec.nbytes) == ("x", "bfloat16", (2, 3), 12)


def test_the_gloo_groups_store_listens_on_its_host_only():
    """The weight-sync store of a CPU server listens on the server's --host, not on every
    interface as torch's TCPStore alone does: from another address of this machine the port is
    closed."""
    import socket

    from swift_megatron.rollout.weight_sync import GlooCommunicator
    from tests.distributed.launch import free_port

    other = outward_address()
    port = free_port()
    comm = GlooCommunicator("127.0.0.1", port, 0, 1, timeout_s=10)
    try:
        comm.broadcast(torch.ones(2), 0)   # a group of one works
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
        if other is None:
            pytest.skip("this machine has no non-loopback IPv4 address to probe from")
        with pytest.raises(OSError):
            socket.create_connection((other, port), timeout=5).close()
    finally:
        comm.close()


def outward_address():
    """This machine's non-loopback IPv4 address, or None."""
    import socket

    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.1", 9))   # no packet is sent: this picks the outward address
        address = probe.getsockname()[0]
    except OSError:
        return None
    finally:
        probe.close()
    return None if address.startswith("127.") else address


@pytest.mark.parametrize("where", ["loopback", "outward"])
def test_the_gloo_groups_connections_use_the_hosts_address(where):
    """A two-rank weight-sync group on `host` opens its gloo listeners on that address only
    (gloo's default is the address of the machine's hostname). Both a loopback and an outward
    host are tried: whichever the hostname resolves to, the other one tells the difference."""
    import threading

    import psutil

    from swift_megatron.rollout.weight_sync import GlooCommunicator
    from tests.distributed.launch import free_port

    host = "127.0.0.1" if where == "loopback" else outward_address()
    if host is None:
        pytest.skip("this machine has no non-loopback IPv4 address")

    def listening():
        return {c.laddr for c in psutil.Process().net_connections("tcp")
                if c.status == psutil.CONN_LISTEN}

    before, port, comms = listening(), free_port(), [None, None]

    def join(rank):
        comms[rank] = GlooCommunicator(host, port, rank, 2, timeout_s=30)

    threads = [threading.Thread(target=join, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        new = listening() - before
        assert new and {address.ip for address in new} == {host}, new
        tensors = [torch.arange(4.0), torch.zeros(4)]
        threads = [threading.Thread(target=comms[r].broadcast, args=(tensors[r], 0))
                   for r in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert torch.equal(tensors[1], torch.arange(4.0))
    finally:
        for comm in comms:
            comm.close()
