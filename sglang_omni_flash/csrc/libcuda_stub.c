/*
 * A stand-in libcuda.so.1 for CPU-only machines.
 *
 * Why: with SGLANG_USE_CPU_ENGINE=1, sglang imports sgl_kernel at import time, and the
 * PyPI sgl-kernel is a CUDA build whose shared objects are linked against libcuda.so.1.
 * Without a driver the dynamic loader refuses to load them. These symbols let the loader
 * succeed; every one returns CUDA_ERROR_STUB_LIBRARY (34), so nothing can run on a GPU
 * by accident and torch.cuda.is_available() stays False.
 *
 * The symbol list is what sgl-kernel 0.4.9's *.so files import from libcuda (nm -D
 * --undefined-only), plus the entry points the CUDA runtime probes first.
 */
#define CUDA_ERROR_STUB_LIBRARY 34

#define STUB(name) \
    int name(void) { return CUDA_ERROR_STUB_LIBRARY; }

STUB(cuInit)
STUB(cuDriverGetVersion)
STUB(cuDeviceGet)
STUB(cuDeviceGetCount)
STUB(cuDeviceGetAttribute)
STUB(cuDeviceGetName)
STUB(cuGetProcAddress)
STUB(cuGetProcAddress_v2)
STUB(cuGetExportTable)
STUB(cuCtxFromGreenCtx)
STUB(cuCtxPopCurrent_v2)
STUB(cuCtxPushCurrent_v2)
STUB(cuDevResourceGenerateDesc)
STUB(cuDevSmResourceSplitByCount)
STUB(cuDeviceGetDevResource)
STUB(cuGreenCtxCreate)
STUB(cuGreenCtxDestroy)
STUB(cuGreenCtxGetDevResource)
STUB(cuPointerGetAttribute)
STUB(cuStreamCreate)

/* cuGetErrorString(CUresult, const char**) must hand back a readable message. */
int cuGetErrorString(int error, const char **message) {
    (void)error;
    if (message) *message = "CUDA driver stub (sglang-omni-flash CPU mode): no GPU on this machine";
    return 0;
}
