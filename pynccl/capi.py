"""The low-level layer's public names: NCCL's structs, the library objects, the tables.

``pynccl.lib()`` returns the loaded :class:`NcclLibrary`; its attributes are NCCL's
functions by their C names. This module gives the types those functions take::

    from pynccl.capi import ncclUniqueId, make_config
"""

from __future__ import annotations

from ._capi.cudart import CUDART_PROTOTYPES, CudartLibrary
from ._capi.nccl import PROTOTYPES, NcclLibrary, decode_version
from ._capi.structs import (
    NCCL_API_MAGIC,
    NCCL_CONFIG_UNDEF_INT,
    NCCL_SPLIT_NOCOLOR,
    NCCL_UNIQUE_ID_BYTES,
    cudaPointerAttributes,
    make_coll_config,
    make_config,
    make_sim_info,
    ncclCollConfig_t,
    ncclConfig_t,
    ncclConfigExt_t,
    ncclEncryptionConfig_t,
    ncclSimInfo_t,
    ncclUniqueId,
    ncclWaitSignalDesc_t,
)

__all__ = [
    "CUDART_PROTOTYPES",
    "NCCL_API_MAGIC",
    "NCCL_CONFIG_UNDEF_INT",
    "NCCL_SPLIT_NOCOLOR",
    "NCCL_UNIQUE_ID_BYTES",
    "PROTOTYPES",
    "CudartLibrary",
    "NcclLibrary",
    "cudaPointerAttributes",
    "decode_version",
    "make_coll_config",
    "make_config",
    "make_sim_info",
    "ncclCollConfig_t",
    "ncclConfigExt_t",
    "ncclConfig_t",
    "ncclEncryptionConfig_t",
    "ncclSimInfo_t",
    "ncclUniqueId",
    "ncclWaitSignalDesc_t",
]
