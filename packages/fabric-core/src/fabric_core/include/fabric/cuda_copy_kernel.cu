// fabric's copy-list kernel: one launch moves a batch of (src, dst, len) segments, so the CUDA
// IPC domain pays one launch per poll instead of one copy-engine operation per work request.
// fabric/cuda_copy_kernel.hpp embeds the PTX that NVRTC makes of this file (see there).
struct FabricSeg {
    unsigned long long src, dst, len;
};

extern "C" __global__ void __launch_bounds__(512) fabric_copy_list(const FabricSeg* segs, unsigned n) {
    __shared__ FabricSeg s;
    const unsigned long long t = threadIdx.x, step = blockDim.x;
    for (unsigned i = blockIdx.x; i < n; i += gridDim.x) {
        if (t == 0) s = segs[i];
        __syncthreads();
        const unsigned long long src = s.src, dst = s.dst, len = s.len;
        __syncthreads();
        unsigned long long done = 0;
        if (((src | dst) & 15) == 0) {
            const uint4* a = reinterpret_cast<const uint4*>(src);
            uint4* b = reinterpret_cast<uint4*>(dst);
            const unsigned long long nv = len >> 4;
            unsigned long long k = t;
            for (; k + 3 * step < nv; k += 4 * step) {  // four loads in flight per thread
                const uint4 v0 = a[k], v1 = a[k + step], v2 = a[k + 2 * step], v3 = a[k + 3 * step];
                b[k] = v0;
                b[k + step] = v1;
                b[k + 2 * step] = v2;
                b[k + 3 * step] = v3;
            }
            for (; k < nv; k += step) b[k] = a[k];
            done = nv << 4;
        }
        const unsigned char* a = reinterpret_cast<const unsigned char*>(src);
        unsigned char* b = reinterpret_cast<unsigned char*>(dst);
        for (unsigned long long k = done + t; k < len; k += step) b[k] = a[k];
    }
}
