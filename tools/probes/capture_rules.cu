// Which CUDA runtime calls are refused while a stream is being captured, from the capturing thread
// and from another, in global and thread-local capture mode, with and without relaxed mode -- and
// whether each call invalidates the capture. The rules cucache's capture handling and the
// simulated device's capture model follow (docs/design.md, "Graph capture") were read off this
// program's output on the H200 (docs/verified.md). Not part of the build; run on a GPU:
//   nvcc -O2 -std=c++17 -o capture_rules tools/probes/capture_rules.cu && ./capture_rules
#include <cuda_runtime.h>
#include <cstdio>
#include <thread>
static const char* st(cudaStream_t s) {
  cudaStreamCaptureStatus c; unsigned long long id;
  cudaStreamGetCaptureInfo(s, &c, &id);
  return c == cudaStreamCaptureStatusActive ? "active" : c == cudaStreamCaptureStatusInvalidated ? "INVALIDATED" : "none";
}
__global__ void k(int* p) { *p = 1; }
template <class F> void trial(const char* name, cudaStreamCaptureMode mode, F f) {
  cudaStream_t a, b; cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking); cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking);
  int* d; cudaMalloc(&d, 4);
  cudaGetLastError();
  cudaStreamBeginCapture(a, mode);
  k<<<1,1,0,a>>>(d);
  cudaError_t e = f(a, b);
  printf("%-52s mode=%d -> %s(%d); capture %s\n", name, (int)mode, cudaGetErrorName(e), (int)e, st(a));
  cudaGraph_t g; cudaError_t ee = cudaStreamEndCapture(a, &g);
  if (ee == cudaSuccess) cudaGraphDestroy(g);
  cudaGetLastError();
  cudaFree(d); cudaStreamDestroy(a); cudaStreamDestroy(b);
}
int main() {
  for (auto mode : {cudaStreamCaptureModeGlobal, cudaStreamCaptureModeThreadLocal}) {
    trial("GetId(capturing stream), same thread", mode, [](cudaStream_t a, cudaStream_t) { unsigned long long id; return cudaStreamGetId(a, &id); });
    trial("GetId(other stream), same thread", mode, [](cudaStream_t, cudaStream_t b) { unsigned long long id; return cudaStreamGetId(b, &id); });
    trial("GetId(capturing stream), other thread", mode, [](cudaStream_t a, cudaStream_t) { cudaError_t e; std::thread t([&]{ unsigned long long id; e = cudaStreamGetId(a, &id); }); t.join(); return e; });
    trial("GetId(other stream), other thread", mode, [](cudaStream_t, cudaStream_t b) { cudaError_t e; std::thread t([&]{ unsigned long long id; e = cudaStreamGetId(b, &id); }); t.join(); return e; });
    trial("GetId(capturing) relaxed, same thread", mode, [](cudaStream_t a, cudaStream_t) { cudaStreamCaptureMode m = cudaStreamCaptureModeRelaxed; cudaThreadExchangeStreamCaptureMode(&m); unsigned long long id; cudaError_t e = cudaStreamGetId(a, &id); cudaThreadExchangeStreamCaptureMode(&m); return e; });
    trial("GetCaptureInfo(other), other thread", mode, [](cudaStream_t, cudaStream_t b) { cudaError_t e; std::thread t([&]{ cudaStreamCaptureStatus c; unsigned long long id; e = cudaStreamGetCaptureInfo(b, &c, &id); }); t.join(); return e; });
    trial("cudaMalloc, other thread", mode, [](cudaStream_t, cudaStream_t) { cudaError_t e; std::thread t([&]{ void* p; e = cudaMalloc(&p, 1<<20); if (!e) cudaFree(p); }); t.join(); return e; });
    trial("cudaMalloc relaxed, other thread", mode, [](cudaStream_t, cudaStream_t) { cudaError_t e; std::thread t([&]{ cudaStreamCaptureMode m = cudaStreamCaptureModeRelaxed; cudaThreadExchangeStreamCaptureMode(&m); void* p; e = cudaMalloc(&p, 1<<20); cudaThreadExchangeStreamCaptureMode(&m); }); t.join(); return e; });
    trial("cudaMalloc relaxed, same thread", mode, [](cudaStream_t, cudaStream_t) { cudaStreamCaptureMode m = cudaStreamCaptureModeRelaxed; cudaThreadExchangeStreamCaptureMode(&m); void* p; cudaError_t e = cudaMalloc(&p, 1<<20); cudaThreadExchangeStreamCaptureMode(&m); return e; });
    trial("EventRecord(other stream), other thread", mode, [](cudaStream_t, cudaStream_t b) { cudaError_t e; std::thread t([&]{ cudaEvent_t ev; cudaEventCreateWithFlags(&ev, cudaEventDisableTiming); e = cudaEventRecord(ev, b); cudaEventDestroy(ev);}); t.join(); return e; });
    trial("EventQuery(other stream ev), other thread", mode, [](cudaStream_t, cudaStream_t b) { cudaError_t e; cudaEvent_t ev; cudaEventCreateWithFlags(&ev, cudaEventDisableTiming); std::thread t([&]{ cudaEventRecord(ev, b); e = cudaEventQuery(ev); }); t.join(); cudaEventDestroy(ev); return e; });
    trial("MemGetInfo, other thread", mode, [](cudaStream_t, cudaStream_t) { cudaError_t e; std::thread t([&]{ size_t f, tt; e = cudaMemGetInfo(&f, &tt);}); t.join(); return e; });
    trial("EventQuery relaxed (other stream ev), other thread", mode, [](cudaStream_t, cudaStream_t b) { cudaError_t e; cudaEvent_t ev; cudaEventCreateWithFlags(&ev, cudaEventDisableTiming); std::thread t([&]{ cudaEventRecord(ev, b); cudaStreamCaptureMode m = cudaStreamCaptureModeRelaxed; cudaThreadExchangeStreamCaptureMode(&m); e = cudaEventQuery(ev); cudaThreadExchangeStreamCaptureMode(&m); }); t.join(); cudaEventDestroy(ev); return e; });
    trial("StreamSync relaxed (other stream), other thread", mode, [](cudaStream_t, cudaStream_t b) { cudaError_t e; std::thread t([&]{ cudaStreamCaptureMode m = cudaStreamCaptureModeRelaxed; cudaThreadExchangeStreamCaptureMode(&m); e = cudaStreamSynchronize(b); cudaThreadExchangeStreamCaptureMode(&m); }); t.join(); return e; });
    trial("StreamSync (other stream), other thread", mode, [](cudaStream_t, cudaStream_t b) { cudaError_t e; std::thread t([&]{ e = cudaStreamSynchronize(b); }); t.join(); return e; });
    trial("EventSync relaxed (other stream ev), other thread", mode, [](cudaStream_t, cudaStream_t b) { cudaError_t e; cudaEvent_t ev; cudaEventCreateWithFlags(&ev, cudaEventDisableTiming); std::thread t([&]{ cudaEventRecord(ev, b); cudaStreamCaptureMode m = cudaStreamCaptureModeRelaxed; cudaThreadExchangeStreamCaptureMode(&m); e = cudaEventSynchronize(ev); cudaThreadExchangeStreamCaptureMode(&m); }); t.join(); cudaEventDestroy(ev); return e; });
    trial("DeviceSync relaxed, other thread", mode, [](cudaStream_t, cudaStream_t) { cudaError_t e; std::thread t([&]{ cudaStreamCaptureMode m = cudaStreamCaptureModeRelaxed; cudaThreadExchangeStreamCaptureMode(&m); e = cudaDeviceSynchronize(); cudaThreadExchangeStreamCaptureMode(&m); }); t.join(); return e; });
    trial("cudaFree relaxed, other thread", mode, [](cudaStream_t, cudaStream_t) { void* p; cudaMalloc(&p, 1<<20); cudaError_t e; std::thread t([&]{ cudaStreamCaptureMode m = cudaStreamCaptureModeRelaxed; cudaThreadExchangeStreamCaptureMode(&m); e = cudaFree(p); cudaThreadExchangeStreamCaptureMode(&m); }); t.join(); return e; });
    trial("cudaFree relaxed, same thread", mode, [](cudaStream_t, cudaStream_t) { void* p; cudaMalloc(&p, 1<<20); cudaStreamCaptureMode m = cudaStreamCaptureModeRelaxed; cudaThreadExchangeStreamCaptureMode(&m); cudaError_t e = cudaFree(p); cudaThreadExchangeStreamCaptureMode(&m); return e; });
    trial("EventRecord(capturing stream) + EventQuery relaxed", mode, [](cudaStream_t a, cudaStream_t) { cudaEvent_t ev; cudaEventCreateWithFlags(&ev, cudaEventDisableTiming); cudaError_t e = cudaEventRecord(ev, a); cudaStreamCaptureMode m = cudaStreamCaptureModeRelaxed; cudaThreadExchangeStreamCaptureMode(&m); cudaError_t q = cudaEventQuery(ev); cudaThreadExchangeStreamCaptureMode(&m); printf("   (record %d, query %d) ", (int)e, (int)q); cudaEventDestroy(ev); return q; });
  }
}
