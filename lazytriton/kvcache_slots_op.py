"""The torch op of ``write_kvcache_slots``: ``lazytriton::kvcache_slots``, with its fake twin.

``lazytriton::kvcache_slots(key, value, key_cache, value_cache,
slot_mapping, k_descale=None, v_descale=None) -> ()`` writes key and value into the caches at their slots in
place, so both caches are declared mutated (``Tensor(a!)``):
``torch.compile`` functionalises the write and keeps it ordered before the
attention that reads the caches. It returns nothing; the fake checks the
shapes and does nothing else.

Registered on first use by ``lazytriton.kvcache_slots`` (an eager call with
nothing tracing goes to the binding directly and never registers it).
"""

from __future__ import annotations

import torch

from lazytriton.kernels.arguments import index_tensor
from lazytriton.kernels.kv_slots import binding, checks

_SCHEMA = ("(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slot_mapping, "
           "Tensor? k_descale=None, Tensor? v_descale=None) -> ()")


@torch.library.custom_op("lazytriton::kvcache_slots", mutates_args=("key_cache", "value_cache"), schema=_SCHEMA)
def kvcache_slots(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, k_descale: torch.Tensor | None = None,
                  v_descale: torch.Tensor | None = None) -> None:
    """Write key and value at slot_mapping's slots (checked again: the op can be called directly)."""
    slot_mapping = index_tensor(slot_mapping)
    call = checks.check(key, value, key_cache, value_cache, slot_mapping, k_descale, v_descale)
    binding.write(key, value, key_cache, value_cache, slot_mapping, call, k_descale, v_descale)


@kvcache_slots.register_fake
def _kvcache_slots_fake(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        slot_mapping: torch.Tensor, k_descale: torch.Tensor | None = None,
                        v_descale: torch.Tensor | None = None) -> None:
    checks.check(key, value, key_cache, value_cache, slot_mapping, k_descale, v_descale)


# The overload itself: calling it skips CustomOpDef's Python wrapper.
kvcache_slots_op = torch.ops.lazytriton.kvcache_slots.default
