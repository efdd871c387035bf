"""`HostPages`: one SGLang host KV pool seen as pages: which bytes a page is, and copies between a page of the
pool and a chunk tensor of ours (`MemoryObj.tensor`, staged in our arena).

A page is what the pool's own `get_data_page(index, flat=False)` returns: a strided view into the pool's
`kv_buffer` (MHA `layer_first` [2, L, page, H, D], `page_first` [2, page, L, H, D], `page_first_direct`
[2, 1, L, page, H, D], `page_head` [2, 1, H, page, L, D]; MLA `layer_first` [L, page, 1, dim], `page_first`
[page, L, 1, dim], `page_first_direct` [1, L, page, 1, dim]). The stored chunk has exactly that shape and the
pool's dtype, C order, so SGLang's generic path (flat pages: `get_data_page(flat=True)` /
`set_from_flat_data_page`) and the v1 path read and write the same bytes, and a page is one strided copy each
way (`torch.Tensor.copy_`), straight between SGLang's pool and our arena: no flat bounce page.

The bytes depend on the layout, hence the layout and the page's shape in every key (`keys.py`). A pool whose
`get_data_page` is not a view of its `kv_buffer` (`page_unified`, pools of other kinds) is refused by name at
registration (`UnsupportedPool`). Nothing here imports SGLang: the pool is used through those attributes only.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch

from lmcache_vllm.storage.codec import ChunkSpec


class UnsupportedPool(ValueError):
    """A host pool whose pages this backend cannot address (the message says which and why)."""


class HostPages:
    def __init__(self, pool: Any, name: str = "kv"):
        self.pool = pool
        self.name = name
        self.layout = str(getattr(pool, "layout", ""))
        self.page_size = int(getattr(pool, "page_size", 0))
        buffer = getattr(pool, "kv_buffer", None)
        what = f"host pool {name!r} ({type(pool).__name__}, layout {self.layout!r})"
        if self.page_size <= 0 or not isinstance(buffer, torch.Tensor):
            raise UnsupportedPool(f"{what}: no page size or no single kv_buffer tensor")
        if buffer.device.type != "cpu":
            raise UnsupportedPool(f"{what}: kv_buffer on {buffer.device}, expected host memory")
        try:
            probe = pool.get_data_page(0, flat=False)
        except (ValueError, NotImplementedError, AttributeError) as exc:
            raise UnsupportedPool(f"{what}: get_data_page refused ({exc})") from None
        if not isinstance(probe, torch.Tensor) or probe.untyped_storage().data_ptr() != \
                buffer.untyped_storage().data_ptr():
            raise UnsupportedPool(f"{what}: a page is not a view of kv_buffer")
        self.buffer = buffer
        self.shape: tuple[int, ...] = tuple(probe.shape)
        self.dtype: torch.dtype = buffer.dtype
        self.numel = probe.numel()
        self.nbytes = self.numel * buffer.element_size()
        self.size = int(getattr(pool, "size", buffer.numel()))  # host slots (tokens)

    @property
    def spec(self) -> ChunkSpec:
        """The shape and dtype every stored page of this pool has (what a read may allocate)."""
        return self.shape, self.dtype

    def page_starts(self, host_indices: Any, pages: int) -> Optional[list[int]]:
        """The first host slot of each of `pages` pages in `host_indices` (one slot per token, page i from
        `host_indices[i * page_size]`), or None when the indices do not describe that many whole pages of
        this pool (wrong count, a start not on a page boundary or outside the pool)."""
        if not isinstance(host_indices, torch.Tensor) or host_indices.dim() != 1 or \
                host_indices.numel() != pages * self.page_size or host_indices.is_floating_point():
            return None
        starts: list[int] = host_indices[::self.page_size].tolist()
        if any(s < 0 or s % self.page_size or s + self.page_size > self.size for s in starts):
            return None
        return starts

    def view(self, start: int) -> torch.Tensor:
        return self.pool.get_data_page(start, flat=False)  # type: ignore[no-any-return]

    def copy_out(self, start: int, dst: torch.Tensor) -> None:
        """The page at host slot `start` into `dst` (a chunk tensor of `shape`)."""
        dst.view(self.shape).copy_(self.view(start))

    def copy_in(self, start: int, src: torch.Tensor) -> None:
        """`src` (a verified chunk of `shape` and `dtype`) into the page at host slot `start`."""
        self.view(start).copy_(src.view(self.shape))

    def saver(self, start: int) -> Callable[[torch.Tensor], None]:
        """`copy_out` of the page at `start`, for a chunk given later."""
        return functools.partial(self.copy_out, start)

    def loader(self, start: int) -> Callable[[torch.Tensor], None]:
        """`copy_in` into the page at `start`, from a chunk given later."""
        return functools.partial(self.copy_in, start)

    def fill_flat(self, flat: torch.Tensor, dst: torch.Tensor) -> bool:
        """A flat page SGLang's generic path hands over (`get_data_page(flat=True)`) into `dst`; False when
        it is not a page of this pool."""
        if flat.numel() != self.numel or flat.dtype != self.dtype:
            return False
        dst.view(-1).copy_(flat.reshape(-1))
        return True

    def to_flat(self, src: torch.Tensor, flat: torch.Tensor) -> bool:
        """A stored page into the flat page SGLang's generic path allocated (`get_dummy_flat_data_page`)."""
        if flat.numel() != self.numel or flat.dtype != self.dtype or not flat.is_contiguous():
            return False
        flat.view(-1).copy_(src.reshape(-1))
        return True
