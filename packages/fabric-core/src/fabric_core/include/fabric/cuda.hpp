// The few CUDA driver calls fabric's native code needs, loaded at run time; shared by the
// compiled backends (fabric-efa: FI_HMEM_CUDA registrations; fabric-verbs: DMA-BUF; the CUDA
// IPC domain of fabric/cuda_ipc.hpp: IPC handles, copies on its own stream, events).
//
// The backends build and run without CUDA: libcuda.so.1 is opened (dlopen) the first time
// memory is registered, and only these entry points are used: is a pointer device memory and
// of which device, what allocation holds it, and a DMA-BUF file descriptor for that
// allocation (cuMemGetHandleForAddressRange, CUDA 11.7+ with an open-kernel or >= 515 driver).
#pragma once

#include <dlfcn.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <type_traits>

namespace fabric::cuda {

using CUresult = int;
using CUdeviceptr = unsigned long long;
using CUcontext = void*;
using CUstream = void*;
using CUevent = void*;
using CUmodule = void*;
using CUfunction = void*;
struct IpcMemHandle {  // CUipcMemHandle
    char reserved[64];
};
constexpr CUresult kNotReady = 600;              // CUDA_ERROR_NOT_READY
constexpr unsigned kStreamNonBlocking = 1;       // CU_STREAM_NON_BLOCKING
constexpr unsigned kEventDisableTiming = 2;      // CU_EVENT_DISABLE_TIMING
constexpr unsigned kIpcLazyEnablePeerAccess = 1; // CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
constexpr int kPointerAttributeMemoryType = 2;  // CU_POINTER_ATTRIBUTE_MEMORY_TYPE
constexpr int kPointerAttributeDeviceOrdinal = 9;  // CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
constexpr unsigned kMemoryTypeDevice = 2;        // CU_MEMORYTYPE_DEVICE
constexpr int kRangeHandleDmaBufFd = 1;          // CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD

struct Driver {
    void* lib = nullptr;
    CUresult (*pointer_get_attribute)(void*, int, CUdeviceptr) = nullptr;
    CUresult (*mem_get_address_range)(CUdeviceptr*, size_t*, CUdeviceptr) = nullptr;
    CUresult (*mem_get_handle_for_address_range)(void*, CUdeviceptr, size_t, int, unsigned long long) = nullptr;
    CUresult (*get_error_string)(CUresult, const char**) = nullptr;
    // The CUDA IPC domain's (all null where the driver lacks any of them: ipc() is false).
    CUresult (*init)(unsigned) = nullptr;
    CUresult (*device_get)(int*, int) = nullptr;
    CUresult (*primary_ctx_retain)(CUcontext*, int) = nullptr;
    CUresult (*primary_ctx_release)(int) = nullptr;
    CUresult (*ctx_get_current)(CUcontext*) = nullptr;
    CUresult (*ctx_push)(CUcontext) = nullptr;
    CUresult (*ctx_pop)(CUcontext*) = nullptr;
    CUresult (*stream_create)(CUstream*, unsigned) = nullptr;
    CUresult (*stream_destroy)(CUstream) = nullptr;
    CUresult (*stream_synchronize)(CUstream) = nullptr;
    CUresult (*event_create)(CUevent*, unsigned) = nullptr;
    CUresult (*event_record)(CUevent, CUstream) = nullptr;
    CUresult (*event_query)(CUevent) = nullptr;
    CUresult (*event_destroy)(CUevent) = nullptr;
    CUresult (*memcpy_async)(CUdeviceptr, CUdeviceptr, size_t, CUstream) = nullptr;
    // typed copies (optional): they skip the pointer lookups of the generic one
    CUresult (*memcpy_dtod_async)(CUdeviceptr, CUdeviceptr, size_t, CUstream) = nullptr;
    CUresult (*memcpy_htod_async)(CUdeviceptr, const void*, size_t, CUstream) = nullptr;
    CUresult (*ipc_get_mem_handle)(IpcMemHandle*, CUdeviceptr) = nullptr;
    CUresult (*ipc_open_mem_handle)(CUdeviceptr*, IpcMemHandle, unsigned) = nullptr;
    CUresult (*ipc_close_mem_handle)(CUdeviceptr) = nullptr;
    // The copy-list kernel's (fabric/cuda_copy_kernel.hpp; all null where any is missing:
    // kernels() is false and every copy is a cuMemcpy of its own).
    CUresult (*module_load_data)(CUmodule*, const void*) = nullptr;
    CUresult (*module_unload)(CUmodule) = nullptr;
    CUresult (*module_get_function)(CUfunction*, CUmodule, const char*) = nullptr;
    CUresult (*launch_kernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                              CUstream, void**, void**) = nullptr;
    CUresult (*mem_alloc)(CUdeviceptr*, size_t) = nullptr;
    CUresult (*mem_free)(CUdeviceptr) = nullptr;
    CUresult (*mem_alloc_host)(void**, size_t) = nullptr;
    CUresult (*mem_free_host)(void*) = nullptr;
    CUresult (*device_can_access_peer)(int*, int, int) = nullptr;  // (optional)

    static const Driver& get() {
        static Driver d = load();
        return d;
    }
    bool present() const { return pointer_get_attribute != nullptr; }
    bool ipc() const {
        return present() && mem_get_address_range && init && device_get && primary_ctx_retain &&
               primary_ctx_release && ctx_get_current && ctx_push && ctx_pop && stream_create && stream_destroy &&
               stream_synchronize && event_create && event_record && event_query && event_destroy && memcpy_async &&
               ipc_get_mem_handle && ipc_open_mem_handle && ipc_close_mem_handle;
    }

    bool kernels() const {
        return module_load_data && module_unload && module_get_function && launch_kernel && mem_alloc && mem_free &&
               mem_alloc_host && mem_free_host && memcpy_htod_async;
    }

    std::string error(CUresult rc) const {
        const char* s = nullptr;
        if (get_error_string && get_error_string(rc, &s) == 0 && s) return std::string(s) + " (CUresult " + std::to_string(rc) + ")";
        return "CUresult " + std::to_string(rc);
    }

  private:
    static Driver load() {
        Driver d;
        d.lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
        if (!d.lib) return d;
        auto sym = [&](const char* name) { return dlsym(d.lib, name); };
        d.pointer_get_attribute = reinterpret_cast<decltype(d.pointer_get_attribute)>(sym("cuPointerGetAttribute"));
        d.mem_get_address_range = reinterpret_cast<decltype(d.mem_get_address_range)>(sym("cuMemGetAddressRange_v2"));
        d.mem_get_handle_for_address_range =
            reinterpret_cast<decltype(d.mem_get_handle_for_address_range)>(sym("cuMemGetHandleForAddressRange"));
        d.get_error_string = reinterpret_cast<decltype(d.get_error_string)>(sym("cuGetErrorString"));
        auto load_as = [&](auto& fn, const char* name) { fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(sym(name)); };
        load_as(d.init, "cuInit");
        load_as(d.device_get, "cuDeviceGet");
        load_as(d.primary_ctx_retain, "cuDevicePrimaryCtxRetain");
        load_as(d.primary_ctx_release, "cuDevicePrimaryCtxRelease_v2");
        if (!d.primary_ctx_release) load_as(d.primary_ctx_release, "cuDevicePrimaryCtxRelease");
        load_as(d.ctx_get_current, "cuCtxGetCurrent");
        load_as(d.ctx_push, "cuCtxPushCurrent_v2");
        load_as(d.ctx_pop, "cuCtxPopCurrent_v2");
        load_as(d.stream_create, "cuStreamCreate");
        load_as(d.stream_destroy, "cuStreamDestroy_v2");
        load_as(d.stream_synchronize, "cuStreamSynchronize");
        load_as(d.event_create, "cuEventCreate");
        load_as(d.event_record, "cuEventRecord");
        load_as(d.event_query, "cuEventQuery");
        load_as(d.event_destroy, "cuEventDestroy_v2");
        load_as(d.memcpy_async, "cuMemcpyAsync");
        load_as(d.memcpy_dtod_async, "cuMemcpyDtoDAsync_v2");
        load_as(d.memcpy_htod_async, "cuMemcpyHtoDAsync_v2");
        load_as(d.ipc_get_mem_handle, "cuIpcGetMemHandle");
        load_as(d.ipc_open_mem_handle, "cuIpcOpenMemHandle_v2");
        load_as(d.ipc_close_mem_handle, "cuIpcCloseMemHandle");
        load_as(d.module_load_data, "cuModuleLoadData");
        load_as(d.module_unload, "cuModuleUnload");
        load_as(d.module_get_function, "cuModuleGetFunction");
        load_as(d.launch_kernel, "cuLaunchKernel");
        load_as(d.mem_alloc, "cuMemAlloc_v2");
        load_as(d.mem_free, "cuMemFree_v2");
        load_as(d.mem_alloc_host, "cuMemAllocHost_v2");
        load_as(d.mem_free_host, "cuMemFreeHost");
        load_as(d.device_can_access_peer, "cuDeviceCanAccessPeer");
        return d;
    }
};

// Is ``ptr`` CUDA device memory? (False without a driver, or for memory CUDA does not know.)
inline bool is_device_pointer(const void* ptr) {
    const Driver& d = Driver::get();
    if (!d.present()) return false;
    unsigned type = 0;
    CUresult rc = d.pointer_get_attribute(&type, kPointerAttributeMemoryType, reinterpret_cast<CUdeviceptr>(ptr));
    return rc == 0 && type == kMemoryTypeDevice;
}

// The CUDA device ``ptr`` is memory of, or -1 for memory that is not CUDA device memory.
inline int device_ordinal(const void* ptr) {
    if (!is_device_pointer(ptr)) return -1;
    int ordinal = -1;
    CUresult rc = Driver::get().pointer_get_attribute(&ordinal, kPointerAttributeDeviceOrdinal,
                                                      reinterpret_cast<CUdeviceptr>(ptr));
    return rc == 0 ? ordinal : -1;
}

// A DMA-BUF fd for the allocation holding ``ptr``, and ptr's offset in it; -1 and ``why``
// when the driver cannot export one.
inline int dmabuf_fd(const void* ptr, uint64_t& offset, std::string& why) {
    const Driver& d = Driver::get();
    if (!d.mem_get_handle_for_address_range || !d.mem_get_address_range) {
        why = "the CUDA driver has no cuMemGetHandleForAddressRange (CUDA >= 11.7 needed)";
        return -1;
    }
    CUdeviceptr base = 0;
    size_t size = 0;
    CUresult rc = d.mem_get_address_range(&base, &size, reinterpret_cast<CUdeviceptr>(ptr));
    if (rc != 0) {
        why = "cuMemGetAddressRange: " + d.error(rc);
        return -1;
    }
    int fd = -1;
    rc = d.mem_get_handle_for_address_range(&fd, base, size, kRangeHandleDmaBufFd, 0);
    if (rc != 0 || fd < 0) {
        why = "cuMemGetHandleForAddressRange(DMA_BUF_FD): " + d.error(rc) +
              " (needs the open GPU kernel modules or driver >= 515, and kernel DMA-BUF support)";
        return -1;
    }
    offset = reinterpret_cast<CUdeviceptr>(ptr) - base;
    return fd;
}

}  // namespace fabric::cuda
