#define TW 32
#define TH 8
#define PREC 22
#define DESC 16

__device__ __forceinline__ unsigned int clip8(int v) {
  v >>= PREC;
  return v < 0 ? 0u : (v > 255 ? 255u : (unsigned int)v);
}

__device__ __forceinline__ double tri(double x) {
  if (x < 0.0) x = -x;
  return x < 1.0 ? 1.0 - x : 0.0;
}

// Pillow's precompute_coeffs + normalize_coeffs_8bpc for output index o, same double
// arithmetic in the same order (compiled with --fmad=false): bit-identical weights.
__device__ int taps(int o, int in_size, int out_size, int antialias, int* w, int* first) {
  double scale = (double)in_size / (double)out_size;
  double filterscale = (antialias && scale > 1.0) ? scale : 1.0;
  double support = 1.0 * filterscale;
  double center = (o + 0.5) * scale;
  double ss = 1.0 / filterscale;
  int xmin = (int)(center - support + 0.5);
  if (xmin < 0) xmin = 0;
  int xmax = (int)(center + support + 0.5);
  if (xmax > in_size) xmax = in_size;
  xmax -= xmin;
  double ww = 0.0;
  for (int x = 0; x < xmax; x++) ww += tri((x + xmin - center + 0.5) * ss);
  for (int x = 0; x < xmax; x++) {
    double k = tri((x + xmin - center + 0.5) * ss);
    if (ww != 0.0) k /= ww;
    w[x] = k < 0 ? (int)(-0.5 + k * (double)(1 << PREC)) : (int)(0.5 + k * (double)(1 << PREC));
  }
  *first = xmin;
  return xmax;
}

__device__ __forceinline__ unsigned short f2h(float f) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}
__device__ __forceinline__ float cvt(float*, float x) { return x; }
__device__ __forceinline__ unsigned short cvt(unsigned short*, float x) { return f2h(x); }

template <typename T>
__device__ __forceinline__ T emit(unsigned int v, float a, float b) {
  return cvt((T*)0, __fmaf_rn((float)v, a, b));
}
template <>
__device__ __forceinline__ unsigned char emit<unsigned char>(unsigned int v, float, float) {
  return (unsigned char)v;
}

// The taps of every output column and row of every item, once per batch: entry = (first tap,
// tap count, weights...), kx + 2 ints per column and ky + 2 per row. Count 0: padding.
__global__ void taps_table(const long long* __restrict__ desc, int* __restrict__ tab,
                           int antialias, int kx, int ky, int wmax, int hmax) {
  const int item = blockIdx.y, o = blockIdx.x * blockDim.x + threadIdx.x;
  const long long* d = desc + (long long)DESC * item;
  int* tx = tab + (long long)item * (wmax * (kx + 2) + hmax * (ky + 2));
  int* ty = tx + wmax * (kx + 2);
  const int sh = (int)d[1], sw = (int)d[2], rh = (int)d[6], rw = (int)d[7];
  const int top = (int)d[8], left = (int)d[9], oh = (int)d[11], ow = (int)d[12];
  const bool live = d[0] != 0;
  if (o < wmax) {
    int* e = tx + o * (kx + 2);
    int rx = o + left, f = 0, n = 0;
    if (live && o < ow && rx >= 0 && rx < rw) n = taps(rx, sw, rw, antialias, e + 2, &f);
    e[0] = f;
    e[1] = n;
  }
  if (o < hmax) {
    int* e = ty + o * (ky + 2);
    int ry = o + top, f = 0, n = 0;
    if (live && o < oh && ry >= 0 && ry < rh) n = taps(ry, sh, rh, antialias, e + 2, &f);
    e[0] = f;
    e[1] = n;
  }
}

// One block = a TWxTH tile of one item's output window; blockIdx.z = item. The window origin
// (top, left) is in resized coordinates; pixels outside the resized image are padding (value 0).
template <typename T>
__global__ void __launch_bounds__(TW * TH) resample(
    const long long* __restrict__ desc, const int* __restrict__ tab, int wmax, int hmax,
    int C, int chw, int kx, int ky,
    float a0, float a1, float a2, float a3, float b0, float b1, float b2, float b3) {
  extern __shared__ int smem[];
  const int ex = kx + 2, ey = ky + 2;
  int* ct = smem;            // TW x (first, count, kx weights)
  int* rt = ct + TW * ex;    // TH x (first, count, ky weights)
  unsigned char* tmp = (unsigned char*)(rt + TH * ey);  // rows x TW x C, horizontal pass

  const long long* d = desc + (long long)DESC * blockIdx.z;
  const unsigned char* src = (const unsigned char*)d[0];
  const long long sc = d[3], sy = d[4], sx = d[5];
  T* dst = (T*)d[10];
  const int oh = (int)d[11], ow = (int)d[12];
  const int ox0 = blockIdx.x * TW, oy0 = blockIdx.y * TH;
  if (ox0 >= ow || oy0 >= oh) return;  // the same for the whole block
  const int tid = threadIdx.x;
  const bool live = src != 0;
  const int* tx = tab + (long long)blockIdx.z * (wmax * ex + hmax * ey);
  const int* ty = tx + wmax * ex;
  for (int i = tid; i < TW * ex; i += TW * TH)
    ct[i] = (ox0 + i / ex < wmax) ? tx[ox0 * ex + i] : 0;
  for (int i = tid; i < TH * ey; i += TW * TH)
    rt[i] = (oy0 + i / ey < hmax) ? ty[oy0 * ey + i] : 0;
  __syncthreads();

  int r0 = 0x7fffffff, r1 = 0;
  for (int t = 0; t < TH; t++) {
    if (live && rt[t * ey + 1] > 0) {
      r0 = min(r0, rt[t * ey]);
      r1 = max(r1, rt[t * ey] + rt[t * ey + 1]);
    }
  }
  const int nrows = r1 > r0 ? r1 - r0 : 0;
  for (int i = tid; i < nrows * TW; i += TW * TH) {
    const int r = i / TW, col = i - r * TW, n = ct[col * ex + 1];
    if (n == 0) continue;
    const unsigned char* row = src + (long long)(r0 + r) * sy + (long long)ct[col * ex] * sx;
    const int* w = ct + col * ex + 2;
    for (int c = 0; c < C; c++) {
      const unsigned char* p = row + c * sc;
      int acc = 1 << (PREC - 1);
      for (int k = 0; k < n; k++) acc += (int)p[k * sx] * w[k];
      tmp[(r * TW + col) * C + c] = (unsigned char)clip8(acc);
    }
  }
  __syncthreads();

  const int cx = tid % TW, cy = tid / TW, ox = ox0 + cx, oy = oy0 + cy;
  if (ox >= ow || oy >= oh) return;
  const int ny = rt[cy * ey + 1];
  const bool inside = live && ct[cx * ex + 1] > 0 && ny > 0;
  for (int c = 0; c < C; c++) {
    const float a = c == 0 ? a0 : c == 1 ? a1 : c == 2 ? a2 : a3;
    const float b = c == 0 ? b0 : c == 1 ? b1 : c == 2 ? b2 : b3;
    unsigned int v = 0;
    if (inside) {
      const int* w = rt + cy * ey + 2;
      const unsigned char* p = tmp + ((rt[cy * ey] - r0) * TW + cx) * C + c;
      int acc = 1 << (PREC - 1);
      for (int k = 0; k < ny; k++) acc += (int)p[k * TW * C] * w[k];
      v = clip8(acc);
    }
    T out = live ? emit<T>(v, a, b) : (T)0;
    if (chw) dst[((long long)c * oh + oy) * ow + ox] = out;
    else dst[((long long)oy * ow + ox) * C + c] = out;
  }
}

// normalize of a dense batch: contiguous (N, H, W, 3) uint8 in, H*W % 16 == 0, both 16-byte
// aligned; flat over the batch. Every store is one 16-byte vector and a warp's stores are one
// contiguous run (no sector is written in halves): one thread takes PX = 16 / sizeof(T) pixels
// (CHW: three loads of PX bytes, one store per plane) or elements (HWC: one load of PX bytes,
// one store). Streaming stores: a normalized batch is written once and read by someone else.
template <int B> struct Bytes;
template <> struct Bytes<4> { typedef unsigned int t; };
template <> struct Bytes<8> { typedef uint2 t; };
template <> struct Bytes<16> { typedef uint4 t; };

template <typename T>
__device__ __forceinline__ void store_vec(T* p, const T (&v)[16 / sizeof(T)]) {
  union { T e[16 / sizeof(T)]; uint4 u; } w;
#pragma unroll
  for (int i = 0; i < 16 / (int)sizeof(T); i++) w.e[i] = v[i];
  __stcs((uint4*)p, w.u);
}

template <typename T>
__global__ void __launch_bounds__(256) affine_dense(
    const unsigned char* __restrict__ src, T* __restrict__ dst, long long total, int hw, int chw,
    float a0, float a1, float a2, float b0, float b1, float b2) {
  constexpr int PX = 16 / sizeof(T);
  typedef typename Bytes<PX>::t V;
  const long long e = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * PX;
  T v[PX];
  if (chw) {  // e: the first of PX pixels (one image: hw % PX == 0)
    if (e >= total) return;
    const V* p = (const V*)(src + e * 3);
    union { V q[3]; unsigned int w[3 * PX / 4]; } in;
    in.q[0] = __ldcs(p), in.q[1] = __ldcs(p + 1), in.q[2] = __ldcs(p + 2);
    const long long n = e / hw;
    T* base = dst + n * 2 * hw + e;  // = image n's plane 0 at pixel e - n * hw
#pragma unroll
    for (int c = 0; c < 3; c++) {
      const float a = c == 0 ? a0 : c == 1 ? a1 : a2, b = c == 0 ? b0 : c == 1 ? b1 : b2;
#pragma unroll
      for (int i = 0; i < PX; i++) {
        const int k = 3 * i + c;
        v[i] = emit<T>((in.w[k >> 2] >> ((k & 3) * 8)) & 255u, a, b);
      }
      store_vec(base + (long long)c * hw, v);
    }
  } else {  // e: the first of PX elements of the flat (N*H*W*3) array
    if (e >= total * 3) return;
    union { V q; unsigned int w[PX / 4]; } in;
    in.q = __ldcs((const V*)(src + e));
    const int c0 = (int)(e % 3);
#pragma unroll
    for (int i = 0; i < PX; i++) {
      const int c = (c0 + i) % 3;
      const float a = c == 0 ? a0 : c == 1 ? a1 : a2, b = c == 0 ? b0 : c == 1 ? b1 : b2;
      v[i] = emit<T>((in.w[i >> 2] >> ((i & 3) * 8)) & 255u, a, b);
    }
    store_vec(dst + e, v);
  }
}
