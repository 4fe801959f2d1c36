"""Which ranks make the unique ids of a several-id world, and the checks of
``share_parts`` (every backend's exchange of ids made by several ranks).

``ncclCommInitRankScalable`` splits the ``nranks`` ranks into ``nId`` consecutive groups,
one bootstrap root per id; ``ncclGetUniqueId`` starts that root in the calling process.
NCCL (``src/bootstrap.cc``) gives group ``i`` the ranks from ``firstRankFromRoot(i)``:
``i * (nranks // nId) + min(i, nranks % nId)``; so id ``i`` is best made by that rank,
and no process hosts more than one root.
"""

from __future__ import annotations

from collections.abc import Sequence

from ._common import check_share_args

__all__ = ["check_parts_args", "first_rank_from_root", "id_makers"]


def first_rank_from_root(root: int, nranks: int, nroots: int) -> int:
    """The first rank of root ``root``'s group (NCCL's ``firstRankFromRoot``)."""
    return root * (nranks // nroots) + min(root, nranks % nroots)


def id_makers(nranks: int, nids: int) -> list[int]:
    """The rank that makes each of ``nids`` ids for ``nranks`` ranks (rank 0 makes id 0).

    Raises ``ValueError`` naming the values unless ``1 <= nids <= nranks`` (NCCL refuses
    more ids than ranks as improper usage).
    """
    for name, value in (("nranks", nranks), ("nids", nids)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} is not a positive integer")
    if nids > nranks:
        raise ValueError(f"nids={nids} exceeds nranks={nranks}: NCCL takes at most one id per rank")
    return [first_rank_from_root(i, nranks, nids) for i in range(nids)]


def check_parts_args(
    part: bytes | bytearray | memoryview | None,
    rank: int,
    world_size: int,
    makers: Sequence[int],
    timeout: float,
) -> tuple[int | None, bytes | None]:
    """Validate ``share_parts`` arguments: ``(index of this rank's part or None, its bytes)``.

    ``makers`` must be distinct ranks of the world in increasing order, starting with 0;
    a rank in ``makers`` passes its non-empty part, the others pass ``None``.
    """
    check_share_args(b"x", rank, world_size, timeout)  # the world size, rank and timeout
    owners = list(makers)
    if (
        not owners
        or owners[0] != 0
        or any(isinstance(r, bool) or not isinstance(r, int) for r in owners)
        or any(b <= a for a, b in zip(owners, owners[1:]))
        or owners[-1] >= world_size
    ):
        raise ValueError(
            f"makers={owners!r} is not increasing ranks below world_size={world_size} "
            "starting with rank 0"
        )
    if rank not in owners:
        if part is not None:
            raise ValueError(f"rank {rank} makes no part (makers={owners}) but passed one")
        return None, None
    if not isinstance(part, (bytes, bytearray, memoryview)) or not bytes(part):
        raise TypeError(
            f"rank {rank} makes part {owners.index(rank)}: pass it as non-empty bytes, got "
            f"{type(part).__name__}"
        )
    return owners.index(rank), bytes(part)
