// The quantized matmuls' FFI glue: TlQGemm, y [N, O] = x [N, K] @ W^T for W [O, row_bytes] whose
// rows are the raw ggml blocks (32 weights each) of q8_0, q4_0, q4_1, q5_0 or q5_1, or
// super-blocks (256 weights) of q4_k, q5_k or q6_k (the `kind` attribute: quant.h's Kind), N <=
// max_rows(kind); TlQGemmPanels, the same over q8_0, q4_0 or q4_1 weights repacked at load into
// panels of 16 outputs (tl/model/encodings/panels.py; AVX-512 VNNI builds only); TlQGemmMaxRows
// and TlQGemmPanelsBuilt, what this build takes.
//
// Owns: the handlers, their shape checks and the rows a kind takes. Must not: write anything but
// y, or compute (quant_gemm.cc's qgemm_run and qgemm_panels_run do; quant.h says what the
// arithmetic is). Built by kernels/cpu_build.py, called by kernels/cpu_native.py (`qgemm`,
// `qgemm_panels`), tested by tests/kernels/test_cpu_native_quant.py against float64 products of gguf's
// dequantized weights and a numpy emulation of the integer arithmetic, and by
// tests/model/test_panels.py.

#include "quant.h"

namespace tl {
namespace {

// Bytes a block (a super-block for the K-quants) of `kind`; 0 for an unknown kind.
int64_t block_bytes(int32_t kind) {
  int64_t bytes = 0;
  with_kind(kind, [&](auto k) { bytes = Fmt<decltype(k)::value>::kBytes; });
  return bytes;
}

int64_t block_inputs(int32_t kind) { return kind >= kQ4_K ? kQKK : kQK; }

// Whether this build has the panel kernels (AVX-512 VNNI): where it has not, the engine keeps
// the stored rows (TlQGemmPanels then refuses every call).
bool panels_built() {
#if defined(TL_QPANELS)
  return true;
#else
  return false;
#endif
}

// The rows a call of `kind` takes: any count where a panel kernel runs it (AVX-512 VNNI, and
// AVX2's exact family: the formats of 32-input blocks and the K-quants), and the K-quants' any
// count on the other SIMD builds (their tiles take x in runs of an L1's worth, so a row count costs only the weights
// streamed again a run: Gemma 3 270M's q6_k ffn_down at 512 rows ran 1.9x XLA's dequantizing
// dot on Zen 4, its q4_k attn_output 1.24x, at 128-256 rows 0.77-1.0x: the verdicts weigh the
// whole layer chain at 64 rows and at the largest token bucket, not each matrix); else the
// tiles' 64 (the scalar builds: past that their x streams from L2 for every output, and a 512-row
// call would take seconds to measure at start-up). The AVX2 panels ran
// SmolLM2 Q4_1's 512-token prefill at 736-770 tok/s on Zen 3 where 64 rows a call and XLA's dot
// past them gave 510.
int64_t max_rows(int32_t kind) {
#if defined(TL_QDOT_512) || defined(TL_QDOT_256)
  if (kind >= kQ8_0 && kind <= kQ5_1) return kQManyRows;
#endif
#if defined(TL_QDOT_512) || defined(TL_QDOT_256) || defined(TL_QDOT_NEON)
  if (kind >= kQ4_K && kind <= kQ6_K) return kQManyRows;
#endif
  (void)kind;
  return kQFewRows;
}

ffi::Error QGemm(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w, int32_t kind,
                 ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const int64_t bb = block_bytes(kind), bi = block_inputs(kind);
  if (bb == 0) return ffi::Error::InvalidArgument("unknown block kind");
  if (xd.size() != 2 || wd.size() < 2) return ffi::Error::InvalidArgument("expected x [N,K] and w [...,row_bytes]");
  const int64_t N = xd[0], K = xd[1], row_bytes = wd[wd.size() - 1];
  if (K % bi != 0 || row_bytes != K / bi * bb)
    return ffi::Error::InvalidArgument("w's rows are not K / 32 blocks (K / 256 for the K-quants) of this kind");
  if (N > max_rows(kind)) return ffi::Error::InvalidArgument("qgemm takes at most qgemm_max_rows(kind) rows");
  const int64_t O = row_bytes > 0 ? static_cast<int64_t>(w.element_count()) / row_bytes : 0;
  float* Y = y->typed_data();
  if (N == 0 || O == 0) return ffi::Error::Success();
  if (K == 0) {
    std::fill(Y, Y + N * O, 0.0f);
    return ffi::Error::Success();
  }
  qgemm_run(pool, kind, x.typed_data(), N, K, w.typed_data(), O, Y);
  return ffi::Error::Success();
}

ffi::Error QGemmPanels(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w, int32_t kind,
                       ffi::ResultBuffer<ffi::F32> y) {
  if (!panels_built()) return ffi::Error::InvalidArgument("this build has no panel kernels (AVX-512 VNNI)");
  if (kind != kQ8_0 && kind != kQ4_0 && kind != kQ4_1)
    return ffi::Error::InvalidArgument("panels are q8_0, q4_0 or q4_1");
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3)
    return ffi::Error::InvalidArgument("expected x [N,K] and w [panels, blocks, bytes]");
  const int64_t N = xd[0], K = xd[1], panels = wd[0], nb = wd[1];
  if (K != nb * kQK || wd[2] != kPanelOut * block_bytes(kind))
    return ffi::Error::InvalidArgument("w is not panels of 16 outputs' blocks of x's K inputs");
  float* Y = y->typed_data();
  if (N == 0 || panels == 0) return ffi::Error::Success();
  if (K == 0) {
    std::fill(Y, Y + N * panels * kPanelOut, 0.0f);
    return ffi::Error::Success();
  }
  qgemm_panels_run(pool, kind, x.typed_data(), N, K, w.typed_data(), panels, Y);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace tl

extern "C" int64_t TlQGemmMaxRows(int32_t kind) { return tl::max_rows(kind); }
extern "C" int64_t TlQGemmPanelsBuilt() { return tl::panels_built() ? 1 : 0; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(TlQGemmPanels, tl::QGemmPanels,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // x [N, K]
                                  .Arg<ffi::Buffer<ffi::U8>>()     // w [panels, K / 32, 16 block bytes]: repacked
                                  .Attr<int32_t>("kind")           // Kind: 0 q8_0, 1 q4_0, 2 q4_1
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [N, 16 panels]

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    TlQGemm, tl::QGemm,
    ffi::Ffi::Bind()
        .Ctx<ffi::ThreadPool>()
        .Arg<ffi::Buffer<ffi::F32>>()    // x [N, K]
        .Arg<ffi::Buffer<ffi::U8>>()     // w [..., row_bytes]: raw ggml blocks
        .Attr<int32_t>("kind")           // Kind: 0 q8_0, 1 q4_0, 2 q4_1, 3 q5_0, 4 q5_1, 5 q4_k, 6 q5_k, 7 q6_k
        .Ret<ffi::Buffer<ffi::F32>>());  // y [N, ...]
