// Model weights moved into one region backed by transparent huge pages (Linux, CPU only).
//
// A decode step streams every weight once, and on the CPU that stream is the step's cost. MLX's
// CPU allocator takes each tensor from malloc: 4 KB pages, one stretch per tensor, data 8 bytes
// past a 16-byte boundary. Over a decode step's 71 matrices of the 4-bit bench model, a 2-core
// microbenchmark of the quantized kernel read 14.4 GB/s from such buffers and 16.6 GB/s from
// 2 MB pages (plain summing: 17.8 against 24.7 GB/s): a TLB miss every 4 KB breaks the hardware
// prefetcher's stream. So once a model's weights are evaluated they are copied, each 64-byte
// aligned, into one anonymous mapping advised MADV_HUGEPAGE, and every array is pointed at its
// copy in place (the handles the model holds share the array's description, so they all see it).
//
// An MLX buffer on the CPU allocator is a pointer to a size_t holding the buffer's size, with
// the data right after it (mlx/backend/no_gpu/allocator.cpp); each copy gets that header, so
// MLX's size queries keep working, and a deleter that releases the region instead of free().
// That layout is checked before anything moves: if this MLX build lays buffers out differently
// (a GPU backend, another release) nothing is moved.

#include "mlx-sys/src/shim.h"

#include <malloc.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>
#include <unordered_set>

namespace mx = mlx::core;

namespace mlxr {

namespace {

constexpr size_t kHuge = size_t(2) << 20;
constexpr size_t kAlign = 64;

// The regions still mapped: MLX's allocator no longer counts the arrays in them, and an array
// already in one is not moved again.
std::mutex g_regions_m;
std::vector<std::pair<uintptr_t, size_t>> g_regions;

struct Region {
  void* base;
  size_t len;
  Region(void* b, size_t l) : base(b), len(l) {
    std::lock_guard<std::mutex> lock(g_regions_m);
    g_regions.emplace_back(reinterpret_cast<uintptr_t>(b), l);
  }
  ~Region() {
    {
      std::lock_guard<std::mutex> lock(g_regions_m);
      std::erase(g_regions, std::pair{reinterpret_cast<uintptr_t>(base), len});
    }
    munmap(base, len);
  }
};

bool in_a_region(const void* p) {
  const auto at = reinterpret_cast<uintptr_t>(p);
  std::lock_guard<std::mutex> lock(g_regions_m);
  return std::any_of(g_regions.begin(), g_regions.end(), [&](const auto& r) {
    return at >= r.first && at < r.first + r.second;
  });
}

// The old buffers, freed as their arrays move, stay resident otherwise: MLX's buffer cache
// keeps some, and malloc keeps the rest where they sit among live chunks of its heap (most
// tensors are under its mmap threshold). Without this the process held both copies: gemma4
// E2B's peak RSS was 4.4 GB against mlx-lm's 3.8. Giving them back every 64 MB moved bounds the
// extra to about that much.
constexpr size_t kTrimEvery = size_t(64) << 20;

void give_back_freed() {
  mx::clear_cache();
  malloc_trim(0);
}

size_t align_up(size_t v, size_t a) {
  return (v + a - 1) / a * a;
}

// memcpy in slabs, handing each copied slab's source pages back to the kernel at once: the
// source is freed right after, and a large tensor held twice was the peak (gemma4 E2B's
// per-layer embedding table is 1.2 GB; peak RSS 4.3 GB against 3.0 before the move). Only whole
// pages past the buffer's first 64 bytes are discarded, away from malloc's and MLX's headers;
// this is what malloc_trim does to free chunks.
void copy_releasing(char* dst, const char* src, size_t n) {
  constexpr size_t kSlab = size_t(64) << 20;
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t keep = reinterpret_cast<uintptr_t>(src) + 64;
  for (size_t at = 0; at < n; at += kSlab) {
    const size_t len = std::min(kSlab, n - at);
    std::memcpy(dst + at, src + at, len);
    const uintptr_t from = align_up(std::max(keep, reinterpret_cast<uintptr_t>(src + at)), page);
    const uintptr_t to = (reinterpret_cast<uintptr_t>(src + at + len)) / page * page;
    if (to > from) madvise(reinterpret_cast<void*>(from), to - from, MADV_DONTNEED);
  }
}

// Whether MLX reads a buffer's data 8 bytes past its pointer, as this file writes them.
bool buffer_layout_matches() {
  alignas(16) size_t probe[2] = {0, 0};
  mx::allocator::Buffer b(probe);
  return b.raw_ptr() == static_cast<void*>(probe + 1);
}

// An array this can move: evaluated, owning the whole of a buffer no other array shares, laid
// out row-major without gaps, not already in a region.
bool movable(const mx::array& a) {
  return a.is_available() && a.size() > 0 && a.flags().row_contiguous &&
      a.data_size() == a.size() && a.data_shared_ptr() != nullptr &&
      a.data_shared_ptr().use_count() == 1 && a.data<char>() == a.buffer().raw_ptr() &&
      !in_a_region(a.data<char>());
}

}  // namespace

size_t move_to_huge_pages(const ArrVec& v) {
  if (mx::is_available(mx::Device::gpu) || !buffer_layout_matches()) return 0;
  std::vector<mx::array> todo;
  std::unordered_set<uintptr_t> seen;
  size_t total = 0;
  for (const auto& a : v.v) {
    if (!movable(a) || !seen.insert(a.id()).second) continue;
    total = align_up(total + sizeof(size_t), kAlign) + a.nbytes();
    todo.push_back(a);
  }
  if (todo.empty()) return 0;
  const size_t len = align_up(total, kHuge) + kHuge;
  void* raw = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return 0;
  // The mapping is only page-aligned; huge pages need 2 MB alignment, so start at the first
  // 2 MB boundary (the extra 2 MB mapped above is what makes room for that).
  char* base = reinterpret_cast<char*>(align_up(reinterpret_cast<uintptr_t>(raw), kHuge));
  // Before the first touch, so that the copies below fault in huge pages directly. Where THP is
  // off this fails and the region is ordinary memory: still one aligned stretch.
  madvise(base, len - (base - static_cast<char*>(raw)), MADV_HUGEPAGE);
  auto region = std::make_shared<Region>(raw, len);
  size_t at = 0, moved = 0, since_trim = 0;
  for (auto& a : todo) {
    at = align_up(at + sizeof(size_t), kAlign);
    char* data = base + at;
    size_t* header = reinterpret_cast<size_t*>(data) - 1;
    *header = a.nbytes();
    copy_releasing(data, a.data<char>(), a.nbytes());
    at += a.nbytes();
    moved += a.nbytes();
    // The old buffer goes back to MLX's allocator here (this was its only holder).
    a.set_data(mx::allocator::Data(mx::allocator::Buffer(header), [region](mx::allocator::Buffer) {}));
    since_trim += a.nbytes();
    if (since_trim >= kTrimEvery) {
      give_back_freed();
      since_trim = 0;
    }
  }
  give_back_freed();
  return moved;
}

size_t huge_page_bytes() {
  std::lock_guard<std::mutex> lock(g_regions_m);
  size_t total = 0;
  for (const auto& r : g_regions) total += r.second;
  return total;
}

}  // namespace mlxr
