// The compiled data plane of the shared-memory transport: the per-call hot path of every direct
// collective (flag protocol, waits, copies, reductions) and of point-to-point messages (the byte
// rings, and a whole blocking send or receive in one call).
//
// The Python modules beside this file are the reference: collectives.py and
// symmetric_collectives.py (the algorithms), transport.py (the waits and the wake-up protocol),
// segment.py (the layout of a rank's segment), symmetric.py (symmetric allocations), p2p.py (the
// byte rings). This file follows them step for step (same steps, same slots, same control lines,
// same order of reduction), so a result has the same bits whichever runs, and the two interoperate
// on one segment layout.
// Read the Python first; the comments here say only what differs or why the C++ is shaped so.
//
// Memory ordering. The Python relies on x86-64 TSO and on each access being a separate call.
// Here the flags are explicit atomics: a flag is stored with release semantics after the data
// it publishes and loaded with acquire semantics before the data is read, and the "announce
// that I sleep, then re-check" / "publish, then look for sleepers" pair is separated by full
// fences (a locked read-modify-write and atomic_thread_fence(seq_cst)), which rules out the
// lost wake-up exactly as transport.fence() does in Python.
//
// Every entry point takes the GIL only to read its arguments and releases it for the copies,
// reductions and waits, so the group's worker thread and the rank's backward run meanwhile.

#include <torch/extension.h>
#include <pybind11/stl.h>

#include <fcntl.h>
#include <poll.h>
#include <sys/file.h>
#include <pthread.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <utility>
#include <string>
#include <type_traits>
#include <vector>

namespace dataplane {

// ---------------------------------------------------------------------------------------------
// Constants shared with the Python (segment.py, transport.py, collectives.py)
// ---------------------------------------------------------------------------------------------

constexpr int I64_PER_LINE = 8;  // 64-byte control lines of int64
enum Line : int { ARRIVE = 0, DONE = 1, ABORT = 2, PID = 3, RESULT = 4, SLEEPING = 5, CONSUMED = 6, SYMMETRIC = 7 };
// What an entry point returns; Python turns each into its typed exception (compiled.py).
// CORRUPT: a peer wrote words into shared memory that break the protocol (p2p: a ring's head or tail, a
// message's byte count); the Python reference raises the same segment.PeerCorruptError for them.
enum Status : int {
  OK = 0, UNSUPPORTED = 1, PEER_ABORTED = 2, PEER_DIED = 3, TIMED_OUT = 4, MISMATCH = 5, CORRUPT = 6
};
// Reduction codes (compiled.py maps op names to them). AVG = SUM, then a division by P.
enum Op : int { SUM = 0, PROD = 1, MIN = 2, MAX = 3, BAND = 4, BOR = 5, BXOR = 6, AVG = 7 };

constexpr int64_t SMALL_BYTES = 32 << 10;  // collectives.SMALL_BYTES
constexpr double SPIN_MAX_S = 1e-3;        // segment.SPIN_MAX_S
constexpr double SPIN_MIN_S = 5e-6;        // segment.SPIN_MIN_S
constexpr int MAX_BLOCK_MS = 50;           // segment.MAX_BLOCK (seconds there)
constexpr double CHECK_EVERY_S = 0.05;     // segment.CHECK_EVERY
constexpr int CODE_BITS = 56;              // symmetric_collectives.CODE_BITS
constexpr int64_t STEP_MASK = 0x7F;        // symmetric_collectives.STEP_MASK: a SYMMETRIC line's step bits
constexpr int OFFSET_BITS = 40;            // symmetric.OFFSET_BITS: a symmetric code's offset bits
constexpr int HEAD_LINE_0 = 8;             // segment.Layout.head_line(0): the channel to rank q's head is
constexpr int TAIL_LINE_0 = 9;             // on line HEAD_LINE_0 + 2q, its tail on TAIL_LINE_0 + 2q
constexpr int LINES_PER_CHANNEL = 2;
// Every number above, and the ring constants further down, is exported to Python (the module's
// attributes, at the end of this file); compiled.check_extension compares each with the Python
// reference's own at import, so a build from other source is one error, not wrong bits.

#define TRY(expr)                 \
  do {                            \
    int _st = (expr);             \
    if (_st != OK) return _st;    \
  } while (0)

inline double now_s() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

inline void cpu_relax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

// False once the owner of a peer's segment no longer holds its lock (segment.Segment.owner_alive):
// `fd` is this rank's own descriptor of that segment; taking the lock exclusively succeeds only
// when no one holds it (the kernel drops a dead process's locks, whatever its PID namespace). Any
// other failure cannot tell, and reads as alive (the deadline still ends the wait).
bool owner_alive(int fd) {
  if (fd < 0) return true;
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) return true;
  flock(fd, LOCK_UN);
  return false;
}

// Empty this rank's wake-up pipe (segment.Segment.drain).
inline void drain(int fd) {
  char buf[256];
  while (read(fd, buf, sizeof buf) > 0) {
  }
}

// transport.wait, for the collectives (Plane) and point-to-point (Rings) alike: spin (on the
// main thread only, adaptively: `spin` doubles after a wait that ended spinning and halves after
// one that had to block), then block on this rank's wake-up pipe `fd`, announced on its SLEEPING
// line `sleeping`; every CHECK_EVERY_S `check(seconds blocked)` may end the wait with its status.
template <class Ready, class Check>
int spin_then_block(Ready ready, Check check, double& spin, bool may_spin, int64_t* sleeping, int fd) {
  if (ready()) return OK;
  double sp = may_spin ? spin : 0.0;
  if (sp > 0) {
    double end = now_s() + sp;
    do {
      for (int k = 0; k < 32; ++k) {
        if (ready()) {
          if (sp < SPIN_MAX_S) spin = std::min(SPIN_MAX_S, sp * 2);
          return OK;
        }
        cpu_relax();
      }
    } while (now_s() < end);
    spin = std::max(SPIN_MIN_S, sp / 2);
  }
  double start = now_s(), last = start;
  int block = 1;
  while (true) {
    __atomic_fetch_add(sleeping, 1, __ATOMIC_SEQ_CST);  // a locked add: every later load sees what peers stored before it
    bool r = ready();
    if (!r) {
      pollfd p{fd, POLLIN, 0};
      poll(&p, 1, block);
      drain(fd);
    }
    __atomic_fetch_add(sleeping, -1, __ATOMIC_SEQ_CST);
    if (r || ready()) return OK;
    block = std::min(block * 2, MAX_BLOCK_MS);
    double t = now_s();
    if (t - last >= CHECK_EVERY_S) {
      last = t;
      TRY(check(t - start));
    }
  }
}

// chunk_sizes(N, P) of core/util.py: the sizes of torch.tensor_split(t, P).
inline void bounds(int64_t n, int P, int r, int64_t* lo, int64_t* hi) {
  int64_t q = n / P, rem = n % P;
  *lo = r * q + std::min<int64_t>(r, rem);
  *hi = *lo + q + (r < rem ? 1 : 0);
}

// ---------------------------------------------------------------------------------------------
// Reductions: out <- in[0] (op) in[1] (op) ... (op) in[P-1], left to right, element-wise.
//
// Same bits as ops.Op.fold: every partial result is rounded to the element type, so bfloat16
// and float16 add in float and round after each term, as torch's add does. The work runs in
// blocks of 8 KiB: the first two inputs are combined into `out`, then each further input into
// `out` while the block is still in L1. `out` may be in[0] or in[1] (never a later input).
// The element loops are plain loops the compiler vectorises (-O3, this machine's ISA); the
// float16 conversions use F16C where the compiler has it.
// ---------------------------------------------------------------------------------------------

inline float bf16_to_f(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
inline uint16_t f_to_bf16(float f) {  // round to nearest even, NaN stays NaN (c10::BFloat16)
  uint32_t u;
  memcpy(&u, &f, 4);
  if (f != f) return 0x7fc0;
  u += 0x7fff + ((u >> 16) & 1);
  return uint16_t(u >> 16);
}

// torch.minimum/maximum: NaN if either is NaN. On equal values (+0/-0) torch's vectorised
// kernel returns the second argument; so do these.
template <typename T> inline T tmin(T a, T b) {
  if constexpr (std::is_floating_point_v<T>) return (a != a) ? a : (b != b) ? b : (a < b ? a : b);
  else return a < b ? a : b;
}
template <typename T> inline T tmax(T a, T b) {
  if constexpr (std::is_floating_point_v<T>) return (a != a) ? a : (b != b) ? b : (a > b ? a : b);
  else return a > b ? a : b;
}

template <int OP, typename T> inline T combine(T a, T b) {
  if constexpr (OP == SUM || OP == AVG) return T(a + b);
  else if constexpr (OP == PROD) return T(a * b);
  else if constexpr (OP == MIN) return tmin(a, b);
  else if constexpr (OP == MAX) return tmax(a, b);
  else if constexpr (OP == BAND) return T(a & b);
  else if constexpr (OP == BOR) return T(a | b);
  else return T(a ^ b);
}

// o[i] = a[i] (op) b[i]; o may equal a or b (the same element is read before it is written).
template <int OP, typename T> void binop(T* o, const T* a, const T* b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) o[i] = combine<OP, T>(a[i], b[i]);
}

template <int OP> void binop_bf16(uint16_t* o, const uint16_t* a, const uint16_t* b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) o[i] = f_to_bf16(combine<OP, float>(bf16_to_f(a[i]), bf16_to_f(b[i])));
}

template <int OP> void binop_f16(c10::Half* o, const c10::Half* a, const c10::Half* b, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__) && defined(__AVX2__)
  if constexpr (OP == SUM || OP == AVG || OP == PROD) {  // 8 at a time: convert, combine in float, round
    for (; i + 8 <= n; i += 8) {
      __m256 x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + i)));
      __m256 y = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + i)));
      __m256 z = (OP == PROD) ? _mm256_mul_ps(x, y) : _mm256_add_ps(x, y);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o + i), _mm256_cvtps_ph(z, _MM_FROUND_TO_NEAREST_INT));
    }
  }
#endif
  for (; i < n; ++i) o[i] = c10::Half(combine<OP, float>(float(a[i]), float(b[i])));
}

template <int OP, typename T> void binop_any(T* o, const T* a, const T* b, int64_t n) {
  if constexpr (std::is_same_v<T, c10::BFloat16>)
    binop_bf16<OP>(reinterpret_cast<uint16_t*>(o), reinterpret_cast<const uint16_t*>(a),
                   reinterpret_cast<const uint16_t*>(b), n);
  else if constexpr (std::is_same_v<T, c10::Half>)
    binop_f16<OP>(o, a, b, n);
  else
    binop<OP, T>(o, a, b, n);
}

template <int OP, typename T> void fold_t(void* out_, const void* const* in_, int P, int64_t n) {
  T* out = static_cast<T*>(out_);
  constexpr int64_t B = (8 << 10) / sizeof(T);
  if (P == 1) {
    if (out != in_[0]) memcpy(out, in_[0], n * sizeof(T));
    return;
  }
  for (int64_t s = 0; s < n; s += B) {
    int64_t m = std::min(B, n - s);
    binop_any<OP, T>(out + s, static_cast<const T*>(in_[0]) + s, static_cast<const T*>(in_[1]) + s, m);
    for (int q = 2; q < P; ++q) binop_any<OP, T>(out + s, out + s, static_cast<const T*>(in_[q]) + s, m);
  }
}

using FoldFn = void (*)(void*, const void* const*, int, int64_t);

template <typename T> FoldFn fold_for_float(int op) {
  switch (op) {
    case SUM: case AVG: return fold_t<SUM, T>;
    case PROD: return fold_t<PROD, T>;
    case MIN: return fold_t<MIN, T>;
    case MAX: return fold_t<MAX, T>;
    default: return nullptr;  // bitwise ops are not defined on floats (ops.resolve_op refuses them)
  }
}

template <typename T> FoldFn fold_for_int(int op) {
  switch (op) {
    case SUM: return fold_t<SUM, T>;
    case PROD: return fold_t<PROD, T>;
    case MIN: return fold_t<MIN, T>;
    case MAX: return fold_t<MAX, T>;
    case BAND: return fold_t<BAND, T>;
    case BOR: return fold_t<BOR, T>;
    case BXOR: return fold_t<BXOR, T>;
    default: return nullptr;  // avg of integers is refused (it would truncate)
  }
}

// The reduction of `op` on `dtype`, or nullptr where Python would refuse the pair.
FoldFn fold_for(at::ScalarType dtype, int op) {
  switch (dtype) {
    case at::kFloat: return fold_for_float<float>(op);
    case at::kDouble: return fold_for_float<double>(op);
    case at::kHalf: return fold_for_float<c10::Half>(op);
    case at::kBFloat16: return fold_for_float<c10::BFloat16>(op);
    case at::kByte: return fold_for_int<uint8_t>(op);
    case at::kChar: return fold_for_int<int8_t>(op);
    case at::kShort: return fold_for_int<int16_t>(op);
    case at::kInt: return fold_for_int<int32_t>(op);
    case at::kLong: return fold_for_int<int64_t>(op);
    case at::kBool:  // as Gloo: bytes saturated to 0/1; sum is OR, product AND (ops._BOOL_OPS)
      switch (op) {
        case SUM: case BOR: case MAX: return fold_t<BOR, uint8_t>;
        case PROD: case BAND: case MIN: return fold_t<BAND, uint8_t>;
        case BXOR: return fold_t<BXOR, uint8_t>;
        default: return nullptr;
      }
    default: return nullptr;
  }
}

bool supported_dtype(at::ScalarType d) {
  switch (d) {
    case at::kFloat: case at::kDouble: case at::kHalf: case at::kBFloat16: case at::kByte:
    case at::kChar: case at::kShort: case at::kInt: case at::kLong: case at::kBool: return true;
    default: return false;
  }
}

// avg's finish step (ops.Op.finish: t.div_(P)), in the element type.
void divide(void* p, int64_t n, at::ScalarType dtype, int P) {
  switch (dtype) {
    case at::kFloat: { float* x = static_cast<float*>(p); float d = float(P); for (int64_t i = 0; i < n; ++i) x[i] /= d; break; }
    case at::kDouble: { double* x = static_cast<double*>(p); double d = double(P); for (int64_t i = 0; i < n; ++i) x[i] /= d; break; }
    case at::kHalf: { c10::Half* x = static_cast<c10::Half*>(p); float d = float(P); for (int64_t i = 0; i < n; ++i) x[i] = c10::Half(float(x[i]) / d); break; }
    case at::kBFloat16: { uint16_t* x = static_cast<uint16_t*>(p); float d = float(P); for (int64_t i = 0; i < n; ++i) x[i] = f_to_bf16(bf16_to_f(x[i]) / d); break; }
    default: break;
  }
}

// ---------------------------------------------------------------------------------------------
// One symmetric allocation (symmetric.py): its index and every rank's mapping of it.
// ---------------------------------------------------------------------------------------------

struct Symmetric {
  int64_t index, nbytes;
  std::vector<char*> bases;  // group rank -> that rank's copy, mapped here
  int64_t code(int64_t offset) const { return (index + 1) << OFFSET_BITS | offset; }
};

// ---------------------------------------------------------------------------------------------
// The plane of one group: pointers into every rank's segment (mapped by Python, which keeps the
// mappings alive as long as this object), the step counter and the adaptive spin.
// ---------------------------------------------------------------------------------------------

class Plane {
 public:
  Plane(int rank, int size, int slots, int64_t slot_bytes, std::vector<int64_t> ctrl, std::vector<int64_t> coll,
        std::vector<int64_t> wake_fds, std::vector<int64_t> lock_fds, double timeout, int64_t main_thread)
      : rank_(rank), size_(size), slots_(slots), slot_bytes_(slot_bytes), timeout_(timeout),
        main_thread_(static_cast<pthread_t>(main_thread)), lock_fds_(lock_fds) {
    TORCH_CHECK(int(ctrl.size()) == size && int(coll.size()) == size && int(wake_fds.size()) == size &&
                int(lock_fds.size()) == size, "dataplane.Plane: one address and two descriptors per rank");
    for (int q = 0; q < size; ++q) {
      ctrl_.push_back(reinterpret_cast<int64_t*>(ctrl[q]));
      coll_.push_back(reinterpret_cast<char*>(coll[q]));
      wake_.push_back(int(wake_fds[q]));
    }
    scratch_.resize(slot_bytes);
  }

  int64_t step = 0;         // collective steps done (transport.step)
  double spin = SPIN_MAX_S; // seconds a wait spins before it blocks (transport.spin)
  int err_peer = -1;        // after an error: the group rank it concerns (-1: none in particular)
  int64_t err_theirs = 0, err_mine = 0;  // after MISMATCH: the two SYMMETRIC lines

  void add_symmetric(int64_t index, int64_t nbytes, std::vector<int64_t> bases) {
    Symmetric s{index, nbytes, {}};
    for (int64_t b : bases) s.bases.push_back(reinterpret_cast<char*>(b));
    sym_.push_back(s);
  }

  // -- the collectives (tensors as Python passes them: flat, contiguous, on the CPU) -----------

  int all_reduce(const at::Tensor& t, int op) {
    FoldFn f;
    if (!usable(t) || !(f = fold_for(t.scalar_type(), op))) return UNSUPPORTED;
    int64_t n = t.numel(), es = t.element_size();
    char* buf = static_cast<char*>(t.data_ptr());
    at::ScalarType dt = t.scalar_type();
    if (n == 0) return OK;
    pybind11::gil_scoped_release nogil;
    int st = all_reduce_raw(buf, n, es, f);
    if (st == OK && op == AVG) divide(buf, n, dt, size_);
    return st;
  }

  int reduce(const at::Tensor& t, int root, int op) {
    FoldFn f;
    if (!usable(t) || !(f = fold_for(t.scalar_type(), op)) || root < 0 || root >= size_) return UNSUPPORTED;
    int64_t n = t.numel(), es = t.element_size();
    char* buf = static_cast<char*>(t.data_ptr());
    at::ScalarType dt = t.scalar_type();
    if (n == 0) return OK;
    pybind11::gil_scoped_release nogil;
    int64_t m = chunk(es, 1);
    std::vector<const void*> in(size_);
    for (int64_t a = 0; a < n; a += m) {
      int64_t c = std::min(m, n - a);
      char* x = buf + a * es;
      int64_t s = begin();
      memcpy(slot(rank_, s), x, c * es);
      TRY(arrive(s));
      if (rank_ == root) {
        for (int q = 0; q < size_; ++q) in[q] = slot(q, s);
        f(x, in.data(), size_, c);
      }
    }
    if (rank_ == root && op == AVG) divide(buf, n, dt, size_);
    return OK;
  }

  int broadcast(const at::Tensor& t, int root) {
    if (!usable(t) || root < 0 || root >= size_) return UNSUPPORTED;
    int64_t n = t.numel(), es = t.element_size();
    char* buf = static_cast<char*>(t.data_ptr());
    if (n == 0) return OK;
    pybind11::gil_scoped_release nogil;
    int64_t m = chunk(es, 1);
    for (int64_t a = 0; a < n; a += m) {
      int64_t c = std::min(m, n - a);
      int64_t s = begin();
      if (rank_ == root) memcpy(slot(root, s), buf + a * es, c * es);
      TRY(arrive(s));
      if (rank_ != root) memcpy(buf + a * es, slot(root, s), c * es);
    }
    return OK;
  }

  // full: P*n elements, row r already holding this rank's input (api.all_gather puts it there).
  int all_gather(const at::Tensor& full, int64_t n) {
    if (!usable(full) || full.numel() != n * size_) return UNSUPPORTED;
    int64_t es = full.element_size();
    std::vector<char*> rows(size_);
    for (int q = 0; q < size_; ++q) rows[q] = static_cast<char*>(full.data_ptr()) + q * n * es;
    if (n == 0) return OK;
    pybind11::gil_scoped_release nogil;
    return all_gather_rows(rows.data(), rows[rank_], n, es);
  }

  // The fast path's form (api.all_gather): every rank's piece straight into the caller's list.
  int all_gather_list(const std::vector<at::Tensor>& outs, const at::Tensor& in) {
    if (int(outs.size()) != size_ || !usable(in)) return UNSUPPORTED;
    std::vector<char*> rows(size_);
    for (int q = 0; q < size_; ++q) {
      const at::Tensor& t = outs[q];
      if (!usable(t) || t.scalar_type() != in.scalar_type() || t.numel() != in.numel()) return UNSUPPORTED;
      rows[q] = static_cast<char*>(t.data_ptr());
    }
    int64_t n = in.numel(), es = in.element_size();
    const char* src = static_cast<const char*>(in.data_ptr());
    if (n == 0) return OK;
    pybind11::gil_scoped_release nogil;
    return all_gather_rows(rows.data(), src, n, es);
  }

  int gather(const at::Tensor& inp, const c10::optional<at::Tensor>& full, int root) {
    if (!usable(inp) || root < 0 || root >= size_) return UNSUPPORTED;
    int64_t n = inp.numel(), es = inp.element_size();
    if (rank_ == root && (!full.has_value() || !usable(*full) || full->numel() != n * size_)) return UNSUPPORTED;
    const char* in = static_cast<const char*>(inp.data_ptr());
    char* rows = rank_ == root ? static_cast<char*>(full->data_ptr()) : nullptr;
    if (n == 0) return OK;
    pybind11::gil_scoped_release nogil;
    int64_t m = chunk(es, 1);
    for (int64_t a = 0; a < n; a += m) {
      int64_t c = std::min(m, n - a);
      int64_t s = begin();
      memcpy(slot(rank_, s), in + a * es, c * es);
      TRY(arrive(s));
      if (rows)
        for (int q = 0; q < size_; ++q)
          if (q != rank_) memcpy(rows + (q * n + a) * es, slot(q, s), c * es);
    }
    return OK;
  }

  int scatter(const at::Tensor& out, const c10::optional<at::Tensor>& full, int root) {
    if (!usable(out) || root < 0 || root >= size_) return UNSUPPORTED;
    int64_t n = out.numel(), es = out.element_size();
    if (rank_ == root && (!full.has_value() || !usable(*full) || full->numel() != n * size_)) return UNSUPPORTED;
    char* o = static_cast<char*>(out.data_ptr());
    const char* rows = rank_ == root ? static_cast<const char*>(full->data_ptr()) : nullptr;
    if (n == 0) return OK;
    pybind11::gil_scoped_release nogil;
    int64_t m = chunk(es, size_);
    for (int64_t a = 0; a < n; a += m) {
      int64_t c = std::min(m, n - a);
      int64_t s = begin();
      if (rows)
        for (int q = 0; q < size_; ++q) memcpy(slot(rank_, s) + q * c * es, rows + (q * n + a) * es, c * es);
      TRY(arrive(s));
      if (rank_ != root) memcpy(o + a * es, slot(root, s) + rank_ * c * es, c * es);
    }
    return OK;
  }

  // full: P*n elements (block q goes to rank q), read only; out: n elements.
  int reduce_scatter(const at::Tensor& out, const at::Tensor& full, int op) {
    if (!usable(full) || full.scalar_type() != out.scalar_type() || full.numel() != out.numel() * size_)
      return UNSUPPORTED;
    std::vector<const char*> ins(size_);
    int64_t n = out.numel(), es = out.element_size();
    for (int q = 0; q < size_; ++q) ins[q] = static_cast<const char*>(full.data_ptr()) + q * n * es;
    return reduce_scatter_entry(out, ins, op);
  }

  // The fast path's form (api.reduce_scatter): the caller's list of P inputs, read in place.
  int reduce_scatter_list(const at::Tensor& out, const std::vector<at::Tensor>& inputs, int op) {
    if (int(inputs.size()) != size_) return UNSUPPORTED;
    std::vector<const char*> ins(size_);
    for (int q = 0; q < size_; ++q) {
      const at::Tensor& t = inputs[q];
      if (!usable(t) || t.scalar_type() != out.scalar_type() || t.numel() != out.numel()) return UNSUPPORTED;
      ins[q] = static_cast<const char*>(t.data_ptr());
    }
    return reduce_scatter_entry(out, ins, op);
  }

  // -- pieces Python's waits share -----------------------------------------------------------

  // SLEEPING is a count of this rank's threads blocked on its pipe; Python's waits (p2p.py)
  // change it through here too, so concurrent waits of both kinds keep an exact count.
  void sleepers(int delta) { __atomic_fetch_add(line(rank_, SLEEPING), delta, __ATOMIC_SEQ_CST); }

 private:
  int rank_, size_, slots_;
  int64_t slot_bytes_;
  double timeout_;
  pthread_t main_thread_;
  std::vector<int64_t*> ctrl_;
  std::vector<char*> coll_;
  std::vector<int> wake_;
  std::vector<int64_t> lock_fds_;  // this rank's descriptor of each peer's segment (owner_alive)
  std::vector<Symmetric> sym_;
  std::vector<char> scratch_;

  static bool usable(const at::Tensor& t) {
    return t.device().is_cpu() && t.layout() == at::kStrided && t.is_contiguous() && supported_dtype(t.scalar_type());
  }

  int64_t chunk(int64_t es, int per) const { return std::max<int64_t>(1, slot_bytes_ / (es * per)); }

  // -- control lines ---------------------------------------------------------------------------
  int64_t* line(int q, int i) const { return ctrl_[q] + i * I64_PER_LINE; }
  int64_t get(int q, int i) const { return __atomic_load_n(line(q, i), __ATOMIC_ACQUIRE); }
  void set(int i, int64_t v) { __atomic_store_n(line(rank_, i), v, __ATOMIC_RELEASE); }
  char* slot(int q, int64_t s) const { return coll_[q] + (s % slots_) * slot_bytes_; }

  void wake_peers() {
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    for (int q = 0; q < size_; ++q) {
      if (q != rank_ && get(q, SLEEPING)) {
        char b = 0;
        ssize_t w = write(wake_[q], &b, 1);  // a full pipe wakes it already
        (void)w;
      }
    }
  }

  void post(int i, int64_t s) {
    set(i, s);
    wake_peers();
  }

  bool all_at_least(int i, int64_t s) const {
    for (int q = 0; q < size_; ++q)
      if (get(q, i) < s) return false;
    return true;
  }

  int64_t begin() {  // transport.begin
    set(CONSUMED, step);
    return ++step;
  }

  int arrive(int64_t s) {
    post(ARRIVE, s);
    return wait_all(ARRIVE, s);
  }

  int wait_all(int i, int64_t s) {
    return wait([&] { return all_at_least(i, s); });
  }

  // transport.wait: spin (on the main thread only, adaptively), then block on the wake-up pipe.
  template <class Ready> int wait(Ready ready) {
    return spin_then_block(ready, [&](double waited) { return check_peers(waited); }, spin,
                           pthread_equal(pthread_self(), main_thread_), line(rank_, SLEEPING), wake_[rank_]);
  }

  int check_peers(double waited) {
    for (int q = 0; q < size_; ++q) {
      if (q == rank_) continue;
      if (get(q, ABORT)) { err_peer = q; return PEER_ABORTED; }
      if (!owner_alive(int(lock_fds_[q]))) { err_peer = q; return PEER_DIED; }
    }
    if (waited > timeout_) { err_peer = -1; return TIMED_OUT; }
    return OK;
  }

  // -- what each rank works on (symmetric_collectives.declare / check_same) -----------------
  int64_t declare(int64_t s, int64_t code) {
    int64_t l = (s & STEP_MASK) << CODE_BITS | code;
    set(SYMMETRIC, l);
    return l;
  }

  int check_same(int64_t l) {
    int64_t tag = l >> CODE_BITS;
    for (int q = 0; q < size_; ++q) {
      int64_t theirs = get(q, SYMMETRIC);
      if (theirs != l && (theirs >> CODE_BITS) == tag) {
        err_peer = q, err_theirs = theirs, err_mine = l;
        return MISMATCH;
      }
    }
    return OK;
  }

  bool locate(const char* p, int64_t nbytes, const Symmetric** a, int64_t* off) const {
    for (const Symmetric& s : sym_) {
      const char* b = s.bases[rank_];
      if (b <= p && p < b + s.nbytes) {
        if (p + nbytes > b + s.nbytes) return false;
        *a = &s, *off = p - b;
        return true;
      }
    }
    return false;
  }

  // -- all_reduce (collectives.all_reduce) -----------------------------------------------------
  int all_reduce_raw(char* buf, int64_t n, int64_t es, FoldFn f) {
    const Symmetric* a;
    int64_t off;
    if (locate(buf, n * es, &a, &off)) return all_reduce_symmetric(*a, off, n, es, f);
    int P = size_, r = rank_;
    int64_t m = chunk(es, 1);
    std::vector<const void*> in(P);
    if (P == 2 || n * es < SMALL_BYTES) {
      auto count = [&](int64_t i) { return std::min(m, n - i * m); };
      return pipelined(
          (n + m - 1) / m,
          [&](int64_t i, int64_t s) { memcpy(slot(r, s), buf + i * m * es, count(i) * es); },
          [&](int64_t i, int64_t s) {
            for (int q = 0; q < P; ++q) in[q] = slot(q, s);
            f(buf + i * m * es, in.data(), P, count(i));
          });
    }
    for (int64_t s0 = 0; s0 < n; s0 += m) {
      char* x = buf + s0 * es;
      int64_t c = std::min(m, n - s0);
      int64_t s = begin();
      if (!s0 && !sym_.empty()) declare(s, 0);
      if (c * es < SMALL_BYTES) {
        memcpy(slot(r, s), x, c * es);
        TRY(arrive(s));
        for (int q = 0; q < P; ++q) in[q] = slot(q, s);
        f(x, in.data(), P, c);
        continue;
      }
      TRY(reduce_parts(x, c, es, s, f));
    }
    return OK;
  }

  // -- all_gather / reduce_scatter (collectives.all_gather / reduce_scatter) -------------------
  bool adjacent(const char* const* rows, int64_t bytes) const {
    for (int q = 1; q < size_; ++q)
      if (rows[q] != rows[0] + q * bytes) return false;
    return true;
  }

  // rows[q]: where rank q's piece lands on this rank; in: this rank's piece (may be rows[r]).
  int all_gather_rows(char* const* rows, const char* in, int64_t n, int64_t es) {
    int r = rank_;
    if (in != rows[r]) memcpy(rows[r], in, n * es);
    const Symmetric* a;
    int64_t off;
    if (adjacent(rows, n * es) && locate(rows[0], n * size_ * es, &a, &off)) return all_gather_symmetric(*a, off, n, es);
    int64_t l = sym_.empty() ? -1 : declare(step + 1, 0);
    int64_t m = chunk(es, 1);
    for (int64_t s0 = 0; s0 < n; s0 += m) {
      int64_t c = std::min(m, n - s0);
      int64_t s = begin();
      memcpy(slot(r, s), rows[r] + s0 * es, c * es);
      TRY(arrive(s));
      if (l >= 0) {
        TRY(check_same(l));
        l = -1;
      }
      for (int q = 0; q < size_; ++q)
        if (q != r) memcpy(rows[q] + s0 * es, slot(q, s), c * es);
    }
    return OK;
  }

  int reduce_scatter_entry(const at::Tensor& out, const std::vector<const char*>& ins, int op) {
    FoldFn f;
    if (!usable(out) || !(f = fold_for(out.scalar_type(), op))) return UNSUPPORTED;
    int64_t n = out.numel(), es = out.element_size();
    char* o = static_cast<char*>(out.data_ptr());
    at::ScalarType dt = out.scalar_type();
    if (n == 0) return OK;
    pybind11::gil_scoped_release nogil;
    int st = reduce_scatter_rows(o, ins.data(), n, es, f);
    if (st == OK && op == AVG) divide(o, n, dt, size_);
    return st;
  }

  int reduce_scatter_rows(char* o, const char* const* ins, int64_t n, int64_t es, FoldFn f) {
    int r = rank_, P = size_;
    const Symmetric* a;
    int64_t off;
    bool inside = ins[0] < o + n * es && o < ins[0] + n * P * es;  // an output inside the input: the slots
    if (!inside && adjacent(ins, n * es) && locate(ins[0], n * P * es, &a, &off))
      return reduce_scatter_symmetric(*a, off, o, n, es, f);
    int64_t l = sym_.empty() ? -1 : declare(step + 1, 0);
    int64_t m = chunk(es, P);
    std::vector<const void*> in(P);
    for (int64_t s0 = 0; s0 < n; s0 += m) {
      int64_t c = std::min(m, n - s0);
      int64_t s = begin();
      for (int q = 0; q < P; ++q) memcpy(slot(r, s) + q * c * es, ins[q] + s0 * es, c * es);
      TRY(arrive(s));
      if (l >= 0) {
        TRY(check_same(l));
        l = -1;
      }
      for (int q = 0; q < P; ++q) in[q] = slot(q, s) + r * c * es;
      f(o + s0 * es, in.data(), P, c);
    }
    return OK;
  }

  // collectives._pipelined: one-phase steps with up to slots - 1 chunks in flight.
  template <class CopyIn, class Fold> int pipelined(int64_t chunks, CopyIn copy_in, Fold fold) {
    int64_t K = slots_, base = step;
    set(CONSUMED, base);
    int64_t l = sym_.empty() ? -1 : declare(base + 1, 0);
    int64_t posted = 0, folded = 0;
    while (folded < chunks) {
      while (posted < chunks && posted - folded < K - 1) {
        int64_t s = base + 1 + posted;
        if (!all_at_least(CONSUMED, s - K)) {
          if (posted > folded) break;  // fold what is here first: the peer may be waiting for that
          TRY(wait_all(CONSUMED, s - K));
        }
        copy_in(posted, s);
        step = s;
        post(ARRIVE, s);
        ++posted;
      }
      int64_t s = base + 1 + folded;
      TRY(wait_all(ARRIVE, s));
      if (!folded && l >= 0) TRY(check_same(l));
      fold(folded, s);
      ++folded;
      post(CONSUMED, s);
    }
    return OK;
  }

  // collectives._reduce_parts: the two-phase all_reduce of one large chunk (P > 2).
  int reduce_parts(char* x, int64_t c, int64_t es, int64_t s, FoldFn f) {
    int P = size_, r = rank_;
    int64_t lo, hi;
    bounds(c, P, r, &lo, &hi);
    char* mine = slot(r, s);
    if (lo > 0) memcpy(mine, x, lo * es);
    if (hi < c) memcpy(mine + hi * es, x + hi * es, (c - hi) * es);
    TRY(arrive(s));
    if (hi > lo) {
      std::vector<const void*> in(P);
      for (int q = 0; q < P; ++q) in[q] = (q == r ? x : slot(q, s)) + lo * es;
      f(mine + lo * es, in.data(), P, hi - lo);
      memcpy(x + lo * es, mine + lo * es, (hi - lo) * es);
    }
    post(DONE, s);
    TRY(wait_all(DONE, s));
    for (int q = 0; q < P; ++q) {
      int64_t qlo, qhi;
      bounds(c, P, q, &qlo, &qhi);
      if (q != r && qhi > qlo) memcpy(x + qlo * es, slot(q, s) + qlo * es, (qhi - qlo) * es);
    }
    return OK;
  }

  // symmetric_collectives.all_reduce: rank r reduces part r of all P copies and writes it into
  // every copy; two waits for the whole tensor.
  int all_reduce_symmetric(const Symmetric& a, int64_t off, int64_t n, int64_t es, FoldFn f) {
    int P = size_, r = rank_;
    int64_t s = begin();
    int64_t l = declare(s, a.code(off));
    TRY(arrive(s));
    TRY(check_same(l));
    int64_t lo, hi;
    bounds(n, P, r, &lo, &hi);
    int64_t c = std::max<int64_t>(1, slot_bytes_ / (2 * es));
    std::vector<const void*> in(P);
    for (int64_t x = lo; x < hi; x += c) {
      int64_t e = std::min(x + c, hi);
      for (int q = 0; q < P; ++q) in[q] = a.bases[q] + off + x * es;
      char* out = r < 2 ? a.bases[r] + off + x * es : scratch_.data();
      f(out, in.data(), P, e - x);
      for (int q = 0; q < P; ++q)
        if (in[q] != out) memcpy(a.bases[q] + off + x * es, out, (e - x) * es);
    }
    post(DONE, s);
    return wait_all(DONE, s);
  }

  // all_gather on symmetric memory: row r of every rank's buffer holds that rank's input; after
  // every rank arrived, each copies the P-1 other rows straight from their owners' buffers, and
  // the DONE wait keeps a rank from rewriting its row while a peer still reads it.
  int all_gather_symmetric(const Symmetric& a, int64_t off, int64_t n, int64_t es) {
    int64_t s = begin();
    int64_t l = declare(s, a.code(off));
    TRY(arrive(s));
    TRY(check_same(l));
    char* mine = a.bases[rank_] + off;
    for (int q = 0; q < size_; ++q)
      if (q != rank_) memcpy(mine + q * n * es, a.bases[q] + off + q * n * es, n * es);
    post(DONE, s);
    return wait_all(DONE, s);
  }

  // reduce_scatter on symmetric memory: rank r folds block r of every rank's input in place of
  // the copy through the slots; the DONE wait keeps the inputs unchanged until every rank read.
  int reduce_scatter_symmetric(const Symmetric& a, int64_t off, char* o, int64_t n, int64_t es, FoldFn f) {
    int64_t s = begin();
    int64_t l = declare(s, a.code(off));
    TRY(arrive(s));
    TRY(check_same(l));
    std::vector<const void*> in(size_);
    int64_t c = std::max<int64_t>(1, slot_bytes_ / (2 * es));
    for (int64_t x = 0; x < n; x += c) {
      int64_t e = std::min(x + c, n);
      for (int q = 0; q < size_; ++q) in[q] = a.bases[q] + off + (rank_ * n + x) * es;
      f(o + x * es, in.data(), size_, e - x);
    }
    post(DONE, s);
    return wait_all(DONE, s);
  }
};

// ---------------------------------------------------------------------------------------------
// Point-to-point (p2p.py): the byte rings, and a whole blocking send or receive in one call.
//
// The protocol is p2p.py's, byte for byte: ring q of rank s's segment carries s's messages to q,
// s alone writes its bytes and its head (line 8 + 2q of s's ctrl), q alone its tail (line 9 + 2q);
// a message is a 16-byte header [tag, nbytes] and its bytes padded to 16 (padding not written), so
// every head, tail and free space is a multiple of 16 and a header never straddles the end of the
// ring. Bytes are written before the head that covers them (release store) and read after it
// (acquire load); a tail is stored after the bytes it frees were copied out, and the writer loads
// it (acquire) before overwriting them. The matching of messages to receives, the stash and every
// handle stay in Python: p2p.Channels calls push/header/pull as the inner loops of its progress
// engine, and send/recv for a blocking transfer when nothing else is pending (compiled_p2p.py).
//
// Words read from shared memory are data: a peer maps the whole segment and may write anything
// into it. Each head and tail is loaded once, checked (segment.words_ok: multiples of 16, 0 <= tail <=
// head < 2^62, head - tail <= the ring) and only then used as an offset; a header's byte count must
// lie in [0, this host's memory]. A failed check ends the call with BAD_WORDS (push, pull, header)
// or CORRUPT (send, recv) and the words in err_*; Python raises segment.ring_error's PeerCorruptError,
// as its own engine does for the same words. A wait's predicate reads invalid words as "ready", so
// the step after it reports them instead of waiting for the deadline.
//
// Why send and recv cannot deadlock: they run only when the Python engine has nothing to do but
// this one transfer (compiled_p2p.finish checks that), and they *wait* only while that still holds:
// no unread bytes in another incoming ring (for a send: in any incoming ring, the peer's own
// included), and no other thread of this rank asking for the channels (`want`). The moment one
// of those appears, the call returns UNSUPPORTED with its progress (the offset), and the Python
// engine, which drains every direction while it waits, carries on from there. So in every state
// the C++ waits in, the Python engine would also do nothing but wait for this same transfer: the
// compiled path waits no more than the reference does, and the reference cannot deadlock (two
// ranks sending each other more than a ring holds each stash what the other sends).
// ---------------------------------------------------------------------------------------------

constexpr int64_t HEADER = 16;                // p2p.HEADER
constexpr int64_t GIL_FREE_BYTES = 64 << 10;  // copies at least this large release the GIL
constexpr int64_t WORD_LIMIT = int64_t(1) << 62;  // segment.WORD_LIMIT: no head reaches it (2^62 bytes sent)
constexpr int64_t BAD_WORDS = -2;             // push/pull's offset, header's byte count: invalid ring words
constexpr int64_t INVALID = INT64_MAX;        // space_out/avail_in of invalid words: "ready", the next step tells

inline int64_t pad16(int64_t n) { return (n + HEADER - 1) / HEADER * HEADER; }

class Rings {
 public:
  Rings(int rank, int size, int64_t ring_bytes, int64_t chan_offset, double timeout, int64_t main_thread,
        int64_t max_message)
      : rank_(rank), size_(size), R_(ring_bytes), chan_(chan_offset), max_message_(max_message), timeout_(timeout),
        main_thread_(static_cast<pthread_t>(main_thread)), peers_(size) {
    TORCH_CHECK(ring_bytes > 0 && ring_bytes % HEADER == 0, "dataplane.Rings: ring size must be a multiple of 16");
    TORCH_CHECK(max_message >= 0 && max_message < WORD_LIMIT, "dataplane.Rings: max_message out of range");
  }

  double spin = SPIN_MAX_S;  // seconds a wait spins before it blocks (adapted as transport.wait does)
  int err_peer = -1;         // after an error: the peer it concerns (-1: none in particular)
  // after BAD_WORDS / CORRUPT: which ring (to err_peer, in this rank's segment, or from it), the
  // head and tail read, and whether it was a header's byte count (err_count) that was wrong
  bool err_out = false, err_header = false;
  int64_t err_head = 0, err_tail = 0, err_count = 0;

  // Rank q's segment is mapped at `base` (q == rank: this rank's own; before anything else); `lock_fd`:
  // this rank's descriptor of it (owner_alive; -1 for this rank's own).
  void add_peer(int q, int64_t base, int64_t wake_fd, int64_t lock_fd) {
    TORCH_CHECK(q >= 0 && q < size_, "dataplane.Rings.add_peer: no rank ", q);
    peers_[q] = Peer{reinterpret_cast<char*>(base), int(wake_fd), int(lock_fd)};
    if (q != rank_ && std::find(open_.begin(), open_.end(), q) == open_.end()) open_.push_back(q);
  }

  // SLEEPING counts this rank's threads blocked on its pipe, whoever waits (transport._sleepers).
  void sleepers(int delta) { __atomic_fetch_add(ctrl(rank_, SLEEPING), delta, __ATOMIC_SEQ_CST); }

  // Another thread of this rank waits for the channels (compiled_p2p.Guard), or stops waiting:
  // a blocking send/recv in flight hands back as soon as it sees a positive count.
  void want(int delta) {
    __atomic_fetch_add(&want_, delta, __ATOMIC_SEQ_CST);
    if (delta > 0) {
      char b = 0;
      ssize_t w = write(peers_[rank_].wake, &b, 1);  // the owner's own pipe: ends a blocked wait
      (void)w;
    }
  }

  // -- the inner loops of p2p.Channels._push / _pull (compiled_p2p.push / pull) ---------------

  // Write what fits of one message to q (`off` -1: its header is not written yet); returns the
  // new offset into the padded message (p2p._Send.off), or BAD_WORDS. Never waits.
  int64_t push(int q, int64_t tag, const at::Tensor& data, int64_t off) {
    const char* p = bytes_of(data);
    int64_t n = nbytes(data);
    if (n - std::max<int64_t>(off, 0) >= GIL_FREE_BYTES) {
      pybind11::gil_scoped_release nogil;
      return push_raw(q, tag, p, n, off);
    }
    return push_raw(q, tag, p, n, off);
  }

  // The next header from q, consumed: (tag, nbytes); None when no message has begun; (0, BAD_WORDS)
  // when the ring's words or the byte count are invalid (nothing consumed).
  std::optional<std::pair<int64_t, int64_t>> header(int q) {
    int64_t head = load(in_head(q)), tail = relaxed(in_tail(q));
    if (!words_ok(head, tail)) return std::make_pair(int64_t(0), bad(q, false, head, tail));
    if (head - tail < HEADER) return std::nullopt;
    int64_t h[2];
    read_header(q, tail, h);
    if (!count_ok(h[1])) return std::make_pair(int64_t(0), bad_count(q, head, tail, h[1]));
    consume(q, tail + HEADER);
    return std::make_pair(h[0], h[1]);
  }

  // Copy what has arrived of the current message from q into `data` from offset `off` of its
  // padded size `total`; returns the new offset, or BAD_WORDS.
  int64_t pull(int q, const at::Tensor& data, int64_t off, int64_t total) {
    char* p = bytes_of(data);
    int64_t n = nbytes(data);
    if (std::min(avail_in(q), total - off) >= GIL_FREE_BYTES) {
      pybind11::gil_scoped_release nogil;
      return pull_raw(q, p, n, off, total);
    }
    return pull_raw(q, p, n, off, total);
  }

  // -- a whole blocking transfer ---------------------------------------------------------------

  // Send one message to q from offset `off` until all is written: (OK, total), or (status, offset
  // reached) when it hands back (UNSUPPORTED: the Python engine carries on) or fails.
  std::pair<int, int64_t> send(int q, int64_t tag, const at::Tensor& data, int64_t off) {
    const char* p = bytes_of(data);
    int64_t n = nbytes(data), total = pad16(n);
    pybind11::gil_scoped_release nogil;
    while (true) {
      int64_t o = push_raw(q, tag, p, n, off);
      if (o == BAD_WORDS) return {CORRUPT, off};
      off = o;
      if (off == total) return {OK, off};
      int st = wait([&] { return space_out(q) > 0 || busy(-1); }, q);
      if (st != OK) return {st, off};
      if (busy(-1)) return {UNSUPPORTED, off};
    }
  }

  // Receive the next message from q into `data`, which must be the oldest receive posted for
  // (q, tag): from offset `off` (-1: its header is not read yet). A header of another tag or size
  // is left unread (UNSUPPORTED, -1): the Python engine stashes it or reports the wrong size.
  std::pair<int, int64_t> recv(int q, int64_t tag, const at::Tensor& data, int64_t off) {
    char* p = bytes_of(data);
    int64_t n = nbytes(data), total = pad16(n);
    pybind11::gil_scoped_release nogil;
    while (true) {
      if (off < 0) {
        int64_t head = load(in_head(q)), tail = relaxed(in_tail(q));
        if (!words_ok(head, tail)) {
          bad(q, false, head, tail);
          return {CORRUPT, off};
        }
        if (head - tail >= HEADER) {
          int64_t h[2];
          read_header(q, tail, h);
          if (!count_ok(h[1])) {
            bad_count(q, head, tail, h[1]);
            return {CORRUPT, off};
          }
          if (h[0] != tag || h[1] != n) return {UNSUPPORTED, -1};
          consume(q, tail + HEADER);
          off = 0;
        }
      }
      if (off >= 0) {
        int64_t o = pull_raw(q, p, n, off, total);
        if (o == BAD_WORDS) return {CORRUPT, off};
        off = o;
        if (off == total) return {OK, off};
      }
      int64_t need = off < 0 ? HEADER : 1;
      int st = wait([&] { return avail_in(q) >= need || busy(q); }, q);
      if (st != OK) return {st, off};
      if (avail_in(q) < need) return {UNSUPPORTED, off};  // something else needs this rank
    }
  }

 private:
  struct Peer {
    char* base = nullptr;  // the mapped segment; its ctrl lines at offset 0
    int wake = -1;         // its wake-up pipe (this rank's own: the read end)
    int lock_fd = -1;      // this rank's descriptor of its segment (owner_alive)
  };
  int rank_, size_;
  int64_t R_, chan_, max_message_;
  double timeout_;
  pthread_t main_thread_;
  std::vector<Peer> peers_;
  std::vector<int> open_;  // the peers added, in order
  int want_ = 0;

  static char* bytes_of(const at::Tensor& t) {
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "dataplane.Rings: a contiguous CPU tensor is needed");
    return static_cast<char*>(t.data_ptr());
  }
  static int64_t nbytes(const at::Tensor& t) { return t.numel() * t.element_size(); }

  int64_t* ctrl(int q, int i) const { return reinterpret_cast<int64_t*>(peers_[q].base) + i * I64_PER_LINE; }
  // ring to q: in this rank's segment; ring from q: in q's (segment.Layout.head_line/tail_line)
  int64_t* out_head(int q) const { return ctrl(rank_, HEAD_LINE_0 + LINES_PER_CHANNEL * q); }
  int64_t* out_tail(int q) const { return ctrl(rank_, TAIL_LINE_0 + LINES_PER_CHANNEL * q); }
  char* out_ring(int q) const { return peers_[rank_].base + chan_ + q * R_; }
  int64_t* in_head(int q) const { return ctrl(q, HEAD_LINE_0 + LINES_PER_CHANNEL * rank_); }
  int64_t* in_tail(int q) const { return ctrl(q, TAIL_LINE_0 + LINES_PER_CHANNEL * rank_); }
  char* in_ring(int q) const { return peers_[q].base + chan_ + rank_ * R_; }

  // Every word of shared memory is read exactly once per use (an atomic load: the compiler may not
  // read it again between the check and the use); relaxed for this rank's own words (a plain mov).
  static int64_t load(const int64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
  static int64_t relaxed(const int64_t* p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
  static void store(int64_t* p, int64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

  // segment.words_ok: a head and tail that index the ring safely (a few compares per call).
  bool words_ok(int64_t head, int64_t tail) const {
    return ((head | tail) & (HEADER - 1)) == 0 && tail >= 0 && tail <= head && head < WORD_LIMIT && head - tail <= R_;
  }
  bool count_ok(int64_t n) const { return n >= 0 && n <= max_message_; }

  int64_t bad(int q, bool out, int64_t head, int64_t tail) {
    err_peer = q, err_out = out, err_head = head, err_tail = tail, err_header = false, err_count = 0;
    return BAD_WORDS;
  }
  int64_t bad_count(int q, int64_t head, int64_t tail, int64_t n) {
    bad(q, false, head, tail);
    err_header = true, err_count = n;
    return BAD_WORDS;
  }

  int64_t space_out(int q) const {
    int64_t head = relaxed(out_head(q)), tail = load(out_tail(q));
    return words_ok(head, tail) ? R_ - (head - tail) : INVALID;
  }
  int64_t avail_in(int q) const {
    int64_t head = load(in_head(q)), tail = relaxed(in_tail(q));
    return words_ok(head, tail) ? head - tail : INVALID;
  }

  // Whether anything but the transfer with `except` needs this rank (see the section comment).
  bool busy(int except) const {
    if (__atomic_load_n(&want_, __ATOMIC_ACQUIRE) > 0) return true;
    for (int p : open_)
      if (p != except && avail_in(p) > 0) return true;
    return false;
  }

  // `tail`: checked by words_ok, so the header lies inside the ring (16 | tail, 16 | R)
  void read_header(int q, int64_t tail, int64_t* h) const { memcpy(h, in_ring(q) + tail % R_, HEADER); }

  void consume(int q, int64_t tail) {
    store(in_tail(q), tail);  // after the bytes are copied out: the sender may reuse them
    wake(q);
  }

  // transport.wake_peers((q,)): a byte to q's pipe if one of its threads blocks on it.
  void wake(int q) {
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (load(ctrl(q, SLEEPING))) {
      char b = 0;
      ssize_t w = write(peers_[q].wake, &b, 1);  // a full pipe wakes it already
      (void)w;
    }
  }

  int64_t push_raw(int q, int64_t tag, const char* p, int64_t n, int64_t off) {
    int64_t head = relaxed(out_head(q)), tail = load(out_tail(q));
    if (!words_ok(head, tail)) return bad(q, true, head, tail);
    int64_t space = R_ - (head - tail), total = pad16(n);
    char* ring = out_ring(q);
    bool moved = false;
    if (off < 0) {
      if (space < HEADER) return off;
      int64_t h[2] = {tag, n};
      memcpy(ring + head % R_, h, HEADER);
      head += HEADER, space -= HEADER, off = 0, moved = true;
    }
    while (off < total && space > 0) {
      int64_t pos = head % R_;
      int64_t k = std::min({total - off, space, R_ - pos});
      int64_t real = std::min(k, n - off);
      if (real > 0) memcpy(ring + pos, p + off, real);
      off += k, head += k, space -= k, moved = true;
    }
    if (moved) {
      store(out_head(q), head);  // after the bytes it covers
      wake(q);
    }
    return off;
  }

  int64_t pull_raw(int q, char* p, int64_t n, int64_t off, int64_t total) {
    int64_t tail = relaxed(in_tail(q)), head = load(in_head(q));
    if (!words_ok(head, tail)) return bad(q, false, head, tail);
    int64_t avail = head - tail;
    if (avail <= 0 || off >= total) return off;
    const char* ring = in_ring(q);
    while (off < total && avail > 0) {
      int64_t pos = tail % R_;
      int64_t k = std::min({total - off, avail, R_ - pos});
      int64_t real = std::min(k, n - off);
      if (real > 0) memcpy(p + off, ring + pos, real);
      off += k, tail += k, avail -= k;
    }
    consume(q, tail);
    return off;
  }

  template <class Ready> int wait(Ready ready, int q) {
    return spin_then_block(ready, [&](double waited) { return check(q, waited); }, spin,
                           pthread_equal(pthread_self(), main_thread_), ctrl(rank_, SLEEPING), peers_[rank_].wake);
  }

  // transport._check_peers for a point-to-point wait: only its peer counts.
  int check(int q, double waited) {
    if (load(ctrl(q, ABORT))) { err_peer = q; return PEER_ABORTED; }
    if (!owner_alive(peers_[q].lock_fd)) { err_peer = q; return PEER_DIED; }
    if (waited > timeout_) { err_peer = q; return TIMED_OUT; }
    return OK;
  }
};

// out <- fold of `inputs` (for tests and the reduction benchmark against torch's kernels).
int fold(const at::Tensor& out, const std::vector<at::Tensor>& inputs, int op) {
  FoldFn f = fold_for(out.scalar_type(), op);
  if (!f || inputs.empty() || !out.is_contiguous()) return UNSUPPORTED;
  std::vector<const void*> in;
  for (const at::Tensor& t : inputs) {
    if (t.scalar_type() != out.scalar_type() || t.numel() != out.numel() || !t.is_contiguous()) return UNSUPPORTED;
    in.push_back(t.data_ptr());
  }
  void* o = out.data_ptr();
  for (size_t q = 2; q < in.size(); ++q)
    if (in[q] == o) return UNSUPPORTED;  // out may be the first or second input only
  int64_t n = out.numel();
  at::ScalarType dt = out.scalar_type();
  int P = int(in.size());
  pybind11::gil_scoped_release nogil;
  f(o, in.data(), P, n);
  if (op == AVG) divide(o, n, dt, P);
  return OK;
}

// dst <- src's bytes, stored around the caches (non-temporal stores) where the ISA has them: for a buffer
// written every step and read only after a failure (an elastic ZeRO rank's piece in symmetric memory,
// distrain.elastic.pieces.InPlace), so the copy neither reads the destination's lines in first nor evicts
// the training's working set with them. The same bytes as dst.copy_(src) (compiled.stream_copy falls back
// to that for anything but two contiguous CPU tensors of one byte count).
int stream_copy(const at::Tensor& dst, const at::Tensor& src) {
  if (!dst.is_contiguous() || !src.is_contiguous() || dst.device().type() != at::kCPU ||
      src.device().type() != at::kCPU || dst.nbytes() != src.nbytes())
    return UNSUPPORTED;
  char* d = static_cast<char*>(dst.data_ptr());
  const char* s = static_cast<const char*>(src.data_ptr());
  size_t n = dst.nbytes();
  pybind11::gil_scoped_release nogil;
#if defined(__AVX2__) || defined(__SSE2__)
  size_t head = std::min(n, size_t((32 - reinterpret_cast<uintptr_t>(d) % 32) % 32));
  std::memcpy(d, s, head);
  size_t i = head;
#if defined(__AVX2__)
  for (; i + 64 <= n; i += 64) {
    __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
    __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 32));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 32), b);
  }
#else
  for (; i + 32 <= n; i += 32) {
    __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
  }
#endif
  std::memcpy(d + i, s + i, n - i);
  _mm_sfence();  // (the streamed stores are ordered before whatever the caller stores next: a stamp)
#else
  std::memcpy(d, s, n);
#endif
  return OK;
}

std::string isa() {
  std::string s;
#if defined(__AVX512F__)
  s += "avx512f ";
#endif
#if defined(__AVX2__)
  s += "avx2 ";
#endif
#if defined(__F16C__)
  s += "f16c ";
#endif
  if (!s.empty()) s.pop_back();
  return s.empty() ? "baseline" : s;
}

}  // namespace dataplane

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace dataplane;
  m.doc() = "distrain's compiled shared-memory data plane (see _dataplane.cpp and compiled.py)";
  pybind11::class_<Plane>(m, "Plane")
      .def(pybind11::init<int, int, int, int64_t, std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>,
                          std::vector<int64_t>, double, int64_t>())
      .def_readwrite("step", &Plane::step)
      .def_readwrite("spin", &Plane::spin)
      .def_readonly("err_peer", &Plane::err_peer)
      .def_readonly("err_theirs", &Plane::err_theirs)
      .def_readonly("err_mine", &Plane::err_mine)
      .def("add_symmetric", &Plane::add_symmetric)
      .def("all_reduce", &Plane::all_reduce)
      .def("reduce", &Plane::reduce)
      .def("broadcast", &Plane::broadcast)
      .def("all_gather", &Plane::all_gather)
      .def("all_gather_list", &Plane::all_gather_list)
      .def("gather", &Plane::gather)
      .def("scatter", &Plane::scatter)
      .def("reduce_scatter", &Plane::reduce_scatter)
      .def("reduce_scatter_list", &Plane::reduce_scatter_list)
      .def("sleepers", &Plane::sleepers);
  pybind11::class_<Rings>(m, "Rings")
      .def(pybind11::init<int, int, int64_t, int64_t, double, int64_t, int64_t>())
      .def_readwrite("spin", &Rings::spin)
      .def_readonly("err_peer", &Rings::err_peer)
      .def_readonly("err_out", &Rings::err_out)
      .def_readonly("err_header", &Rings::err_header)
      .def_readonly("err_head", &Rings::err_head)
      .def_readonly("err_tail", &Rings::err_tail)
      .def_readonly("err_count", &Rings::err_count)
      .def("add_peer", &Rings::add_peer)
      .def("sleepers", &Rings::sleepers)
      .def("want", &Rings::want)
      .def("push", &Rings::push)
      .def("header", &Rings::header)
      .def("pull", &Rings::pull)
      .def("send", &Rings::send)
      .def("recv", &Rings::recv);
  m.def("fold", &fold);
  m.def("stream_copy", &stream_copy);
  m.def("isa", &isa);
  // Every constant the Python reference also defines, under the name compiled.reference() gives it
  // (compiled.check_extension compares them at import).
  // statuses (enum Status)
  m.attr("OK") = int(OK);
  m.attr("UNSUPPORTED") = int(UNSUPPORTED);
  m.attr("PEER_ABORTED") = int(PEER_ABORTED);
  m.attr("PEER_DIED") = int(PEER_DIED);
  m.attr("TIMED_OUT") = int(TIMED_OUT);
  m.attr("MISMATCH") = int(MISMATCH);
  m.attr("CORRUPT") = int(CORRUPT);
  // reduction codes (enum Op)
  m.attr("OP_SUM") = int(SUM);
  m.attr("OP_PROD") = int(PROD);
  m.attr("OP_MIN") = int(MIN);
  m.attr("OP_MAX") = int(MAX);
  m.attr("OP_BAND") = int(BAND);
  m.attr("OP_BOR") = int(BOR);
  m.attr("OP_BXOR") = int(BXOR);
  m.attr("OP_AVG") = int(AVG);
  // the segment's control lines (enum Line) and the channels' head and tail lines
  m.attr("LINE_BYTES") = I64_PER_LINE * int(sizeof(int64_t));
  m.attr("LINE_ARRIVE") = int(ARRIVE);
  m.attr("LINE_DONE") = int(DONE);
  m.attr("LINE_ABORT") = int(ABORT);
  m.attr("LINE_PID") = int(PID);
  m.attr("LINE_RESULT") = int(RESULT);
  m.attr("LINE_SLEEPING") = int(SLEEPING);
  m.attr("LINE_CONSUMED") = int(CONSUMED);
  m.attr("LINE_SYMMETRIC") = int(SYMMETRIC);
  m.attr("HEAD_LINE_0") = HEAD_LINE_0;
  m.attr("TAIL_LINE_0") = TAIL_LINE_0;
  m.attr("LINES_PER_CHANNEL") = LINES_PER_CHANNEL;
  // the collectives' and symmetric memory's numbers
  m.attr("SMALL_BYTES") = SMALL_BYTES;
  m.attr("CODE_BITS") = CODE_BITS;
  m.attr("STEP_MASK") = STEP_MASK;
  m.attr("OFFSET_BITS") = OFFSET_BITS;
  // the byte rings
  m.attr("HEADER") = HEADER;
  m.attr("WORD_LIMIT") = WORD_LIMIT;
  m.attr("BAD_WORDS") = BAD_WORDS;
  // the waits
  m.attr("SPIN_MAX_S") = SPIN_MAX_S;
  m.attr("SPIN_MIN_S") = SPIN_MIN_S;
  m.attr("MAX_BLOCK_S") = MAX_BLOCK_MS / 1000.0;
  m.attr("CHECK_EVERY_S") = CHECK_EVERY_S;
}
