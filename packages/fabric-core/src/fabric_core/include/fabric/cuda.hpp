// The few CUDA driver calls that registering GPU memory needs, loaded at run time; shared by
// the compiled backends (fabric-efa: FI_HMEM_CUDA registrations; fabric-verbs: DMA-BUF).
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

namespace fabric::cuda {

using CUresult = int;
using CUdeviceptr = unsigned long long;
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

    static const Driver& get() {
        static Driver d = load();
        return d;
    }
    bool present() const { return pointer_get_attribute != nullptr; }

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
