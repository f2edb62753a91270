"""Checked calls into the CUDA driver's virtual memory management API (cuda-bindings).

Every call returns its result or raises `CudaDriverError` naming the driver call and the
driver's error. Imports torch nowhere: the backend decides when a context exists.
"""

from __future__ import annotations

from typing import Any

from cachedaemon.errors import CacheError

try:  # cuda-bindings >= 12.6
    from cuda.bindings import driver as cu
except ImportError:  # pragma: no cover - older cuda-python layout
    try:
        from cuda import cuda as cu
    except ImportError:
        cu = None

FD_HANDLE = (
    None if cu is None else cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
)


class CudaDriverError(CacheError):
    """A CUDA driver call failed (or cuda-bindings is missing)."""


class DeviceBytes:
    """`size` bytes of device memory at `ptr`, as torch takes them (`torch.as_tensor`,
    through `__cuda_array_interface__`): a flat uint8 array. The page at `ptr` must be
    mapped, since torch asks the driver whose memory a pointer is."""

    def __init__(self, ptr: int, size: int) -> None:
        self.ptr, self.size = ptr, size

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {
            "shape": (self.size,),
            "typestr": "|u1",
            "data": (self.ptr, False),
            "version": 3,
            "strides": None,
            "stream": None,
        }


def available() -> bool:
    """Whether cuda-bindings is importable here."""
    return cu is not None


def require_bindings() -> Any:
    if cu is None:
        raise CudaDriverError(
            "backend cuda-vmm needs cuda-bindings: pip install 'holdfast[cuda]' "
            "(or pick --device cpu, which uses the memfd backend)"
        )
    return cu


def check(call: str, result: Any) -> Any:
    """Unpack a cuda-bindings `(CUresult, *values)` tuple; raise on any error."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        _, name = cu.cuGetErrorName(err)
        text = name.decode() if isinstance(name, bytes) else str(err)
        raise CudaDriverError(f"{call} failed: {text}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def primary_context(ordinal: int) -> Any:
    """Retain the device's primary context (the one torch uses) and make it current."""
    require_bindings()
    check("cuInit", cu.cuInit(0))
    device = check("cuDeviceGet", cu.cuDeviceGet(ordinal))
    ctx = check("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(device))
    check("cuCtxSetCurrent", cu.cuCtxSetCurrent(ctx))
    return ctx


def allocation_prop(ordinal: int) -> Any:
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = ordinal
    prop.requestedHandleTypes = FD_HANDLE
    return prop


def granularity(ordinal: int) -> int:
    flag = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
    prop = allocation_prop(ordinal)
    return int(check("cuMemGetAllocationGranularity", cu.cuMemGetAllocationGranularity(prop, flag)))


def access_desc(ordinal: int, writable: bool) -> Any:
    desc = cu.CUmemAccessDesc()
    desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = ordinal
    flags = cu.CUmemAccess_flags
    desc.flags = (
        flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        if writable
        else flags.CU_MEM_ACCESS_FLAGS_PROT_READ
    )
    return desc


def create(ordinal: int, size: int) -> Any:
    """A new physical allocation of `size` bytes, exportable as a POSIX fd."""
    return check("cuMemCreate", cu.cuMemCreate(size, allocation_prop(ordinal), 0))


def export_fd(handle: Any) -> int:
    return int(
        check(
            "cuMemExportToShareableHandle",
            cu.cuMemExportToShareableHandle(handle, FD_HANDLE, 0),
        )
    )


def import_fd(fd: int) -> Any:
    """The allocation behind `fd` (the fd stays open and owned by the caller)."""
    return check("cuMemImportFromShareableHandle", cu.cuMemImportFromShareableHandle(fd, FD_HANDLE))


def set_current(ctx: Any) -> None:
    check("cuCtxSetCurrent", cu.cuCtxSetCurrent(ctx))


def release(handle: Any) -> None:
    check("cuMemRelease", cu.cuMemRelease(handle))


def map_handle(ordinal: int, handle: Any, size: int, align: int, writable: bool) -> int:
    """Reserve a virtual range, map `handle` into it and grant this device access."""
    ptr = check("cuMemAddressReserve", cu.cuMemAddressReserve(size, align, 0, 0))
    try:
        check("cuMemMap", cu.cuMemMap(ptr, size, 0, handle, 0))
    except CudaDriverError:
        cu.cuMemAddressFree(ptr, size)
        raise
    try:
        set_access(ordinal, int(ptr), size, writable)
    except CudaDriverError:
        cu.cuMemUnmap(ptr, size)
        cu.cuMemAddressFree(ptr, size)
        raise
    return int(ptr)


def set_access(ordinal: int, ptr: int, size: int, writable: bool) -> None:
    desc = access_desc(ordinal, writable)
    check("cuMemSetAccess", cu.cuMemSetAccess(cu.CUdeviceptr(ptr), size, [desc], 1))


def unmap(ctx: Any, ptr: int, size: int) -> None:
    """Wait for queued work, then unmap and free the range. Never raises: it runs from
    finalizers, where the process may already be tearing CUDA down."""
    if cu is None:
        return
    cu.cuCtxSetCurrent(ctx)
    cu.cuCtxSynchronize()
    cu.cuMemUnmap(cu.CUdeviceptr(ptr), size)
    cu.cuMemAddressFree(cu.CUdeviceptr(ptr), size)


def reserve(size: int, align: int) -> int:
    """A virtual range of `size` bytes with nothing mapped into it yet."""
    return int(check("cuMemAddressReserve", cu.cuMemAddressReserve(size, align, 0, 0)))


def free_range(ptr: int, size: int) -> None:
    check("cuMemAddressFree", cu.cuMemAddressFree(cu.CUdeviceptr(ptr), size))


def map_at(ordinal: int, ptr: int, size: int, handle: Any, writable: bool) -> None:
    """Map `handle` (at least `size` bytes) at `ptr`, inside a reserved range, and grant
    this device access; nothing stays mapped if either step fails."""
    check("cuMemMap", cu.cuMemMap(cu.CUdeviceptr(ptr), size, 0, handle, 0))
    try:
        set_access(ordinal, ptr, size, writable)
    except CudaDriverError:
        cu.cuMemUnmap(cu.CUdeviceptr(ptr), size)
        raise


def unmap_at(ptr: int, size: int) -> None:
    """Unmap what `map_at` mapped at `ptr` (the range stays reserved); work queued on it
    must be finished."""
    check("cuMemUnmap", cu.cuMemUnmap(cu.CUdeviceptr(ptr), size))


def address_range(ptr: int) -> tuple[int, int]:
    """The base and size of the mapped allocation that holds `ptr`."""
    base, size = check("cuMemGetAddressRange", cu.cuMemGetAddressRange(cu.CUdeviceptr(ptr)))
    return int(base), int(size)


def remap(ordinal: int, ptr: int, size: int, fd: int) -> None:
    """Map the allocation behind `fd` read-only at `ptr`, in place of what was mapped there
    (the range stays reserved, so every pointer into it stays valid). Work queued on the
    range must be finished. A failure after the unmap leaves the range empty: the caller
    cannot go on using it."""
    handle = import_fd(fd)
    try:
        check("cuMemUnmap", cu.cuMemUnmap(cu.CUdeviceptr(ptr), size))
        check("cuMemMap", cu.cuMemMap(cu.CUdeviceptr(ptr), size, 0, handle, 0))
    finally:
        release(handle)  # the mapping keeps the memory alive from here on
    set_access(ordinal, ptr, size, writable=False)
