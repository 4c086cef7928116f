// A model of PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp), fed with
// the storage allocations of one fake CUDA device.  Nothing is allocated: the model replays
// each allocation and free the way the real allocator would place it, so the figures torch's
// memory API reports (memory_allocated/reserved, memory_stats, memory_snapshot) read like a
// GPU run's.  The rules (defaults, no PYTORCH_CUDA_ALLOC_CONF) are written out in
// fakegpu/fake_cuda/allocator.py, which drives this code through cffi; it lives here, in
// C++, because it runs on every tensor allocation of a fake CUDA program.
//
// One stream only: the real allocator keeps blocks of different streams apart, fake devices
// run everything in order.
#include <cstdint>
#include <cstring>
#include <set>
#include <unordered_map>
#include <utility>
#include <vector>

namespace fakegpu::allocator {
namespace {

constexpr uint64_t kMinBlockSize = 512;
constexpr uint64_t kSmallSize = 1ull << 20;
constexpr uint64_t kSmallBuffer = 2ull << 20;
constexpr uint64_t kLargeBuffer = 20ull << 20;
constexpr uint64_t kMinLargeAlloc = 10ull << 20;
constexpr uint64_t kRoundLarge = 2ull << 20;

enum Pool : int { kSmall = 0, kLarge = 1 };
// The order of the stats in the exported table (fakegpu/fake_cuda/allocator.py names them).
enum StatName : int {
  kAllocation = 0, kSegment, kInactiveSplit, kAllocatedBytes, kReservedBytes, kInactiveSplitBytes,
  kRequestedBytes, kStatCount
};
constexpr int kStatPools = 3;   // all, small_pool, large_pool
constexpr int kStatFields = 4;  // current, peak, allocated, freed

uint64_t round_size(uint64_t size) {
  if (size < kMinBlockSize) return kMinBlockSize;
  return kMinBlockSize * ((size + kMinBlockSize - 1) / kMinBlockSize);
}

uint64_t segment_size(uint64_t rounded) {
  if (rounded <= kSmallSize) return kSmallBuffer;
  if (rounded < kMinLargeAlloc) return kLargeBuffer;
  return kRoundLarge * ((rounded + kRoundLarge - 1) / kRoundLarge);
}

Pool pool_of(uint64_t rounded) { return rounded <= kSmallSize ? kSmall : kLarge; }

struct Stat {
  int64_t current = 0, peak = 0, allocated = 0, freed = 0;
  void add(int64_t amount) {
    current += amount;
    allocated += amount;
    if (current > peak) peak = current;
  }
  void sub(int64_t amount) {
    current -= amount;
    freed += amount;
  }
};

struct StatSet {
  Stat by_pool[kStatPools];  // [0] all, [1 + pool]
  void add(Pool pool, int64_t amount) {
    by_pool[0].add(amount);
    by_pool[1 + pool].add(amount);
  }
  void sub(Pool pool, int64_t amount) {
    by_pool[0].sub(amount);
    by_pool[1 + pool].sub(amount);
  }
};

struct Segment;

// A piece of a segment; neighbours are linked, as in the real allocator, so a free merges in
// constant time.
struct Block {
  Segment* segment;
  uint64_t address, size;
  uint64_t requested = 0;
  bool allocated = false;
  Block* prev = nullptr;
  Block* next = nullptr;
  Block(Segment* s, uint64_t a, uint64_t n) : segment(s), address(a), size(n) {}
};

struct Segment {
  uint64_t address, size;
  Pool pool;
  Block* head = nullptr;
  bool wholly_free() const { return head->next == nullptr && !head->allocated; }
};

}  // namespace

class Model {
 public:
  Model(int device, uint64_t total) : total_memory_(total), limit_(total),
      next_address_(0x7F0000000000ull + static_cast<uint64_t>(device) * (1ull << 40)) {}

  // torch.cuda.set_per_process_memory_fraction: the allocator refuses a segment that would take
  // the reserved bytes past fraction x total (CUDACachingAllocator's allowed_memory_maximum).
  void set_limit(uint64_t limit) { limit_ = limit < total_memory_ ? limit : total_memory_; }

  ~Model() {
    for (Segment* s : segments_) {
      for (Block* b = s->head; b != nullptr;) {
        Block* next = b->next;
        delete b;
        b = next;
      }
      delete s;
    }
  }

  // 0 when the device is out of memory (after releasing the cache and retrying once).
  uint64_t malloc(uint64_t nbytes) {
    const uint64_t size = round_size(nbytes);
    const Pool pool = pool_of(size);
    Block* block = best_fit(pool, size);
    if (block == nullptr) {
      block = new_segment(pool, size);
      if (block == nullptr) return 0;
    }
    const uint64_t remaining = block->size - size;
    if (pool == kSmall ? remaining >= kMinBlockSize : remaining > kSmallSize) {
      Block* rest = new Block(block->segment, block->address + size, remaining);
      rest->prev = block;
      rest->next = block->next;
      if (block->next != nullptr) block->next->prev = rest;
      block->next = rest;
      block->size = size;
      insert_free(rest);
      stats_[kInactiveSplit].add(pool, 1);
      stats_[kInactiveSplitBytes].add(pool, static_cast<int64_t>(rest->size));
    }
    block->allocated = true;
    block->requested = nbytes;
    stats_[kAllocation].add(pool, 1);
    stats_[kAllocatedBytes].add(pool, static_cast<int64_t>(block->size));
    stats_[kRequestedBytes].add(pool, static_cast<int64_t>(nbytes));
    const uint64_t handle = next_handle_++;
    handles_.emplace(handle, block);
    return handle;
  }

  // The size the allocator gave an allocation (0 for an unknown handle).
  uint64_t block_size(uint64_t handle) const {
    auto it = handles_.find(handle);
    return it == handles_.end() ? 0 : it->second->size;
  }

  void free(uint64_t handle) {
    auto it = handles_.find(handle);
    if (it == handles_.end()) return;
    Block* block = it->second;
    handles_.erase(it);
    const Pool pool = block->segment->pool;
    stats_[kAllocation].sub(pool, 1);
    stats_[kAllocatedBytes].sub(pool, static_cast<int64_t>(block->size));
    stats_[kRequestedBytes].sub(pool, static_cast<int64_t>(block->requested));
    block->allocated = false;
    block->requested = 0;
    // Merge with free neighbours (each of them was an inactive split).
    Block* neighbours[2] = {block->next, block->prev};
    for (Block* other : neighbours) {
      if (other == nullptr || other->allocated) continue;
      remove_free(other);
      stats_[kInactiveSplit].sub(pool, 1);
      stats_[kInactiveSplitBytes].sub(pool, static_cast<int64_t>(other->size));
      if (other == block->prev) {
        block->address = other->address;
        block->prev = other->prev;
        if (other->prev != nullptr) {
          other->prev->next = block;
        } else {
          block->segment->head = block;
        }
      } else {
        block->next = other->next;
        if (other->next != nullptr) other->next->prev = block;
      }
      block->size += other->size;
      delete other;
    }
    if (block->prev != nullptr || block->next != nullptr) {
      stats_[kInactiveSplit].add(pool, 1);
      stats_[kInactiveSplitBytes].add(pool, static_cast<int64_t>(block->size));
    }
    insert_free(block);
  }

  // empty_cache: give back every segment that holds no allocated block.
  void release_cached() {
    std::vector<Segment*> kept;
    for (Segment* s : segments_) {
      if (s->wholly_free()) {
        remove_free(s->head);
        stats_[kSegment].sub(s->pool, 1);
        stats_[kReservedBytes].sub(s->pool, static_cast<int64_t>(s->size));
        ++num_device_free_;
        delete s->head;
        delete s;
      } else {
        kept.push_back(s);
      }
    }
    segments_.swap(kept);
  }

  void reset_peak() {
    for (StatSet& set : stats_)
      for (Stat& stat : set.by_pool) stat.peak = stat.current;
  }

  void reset_accumulated() {
    for (StatSet& set : stats_)
      for (Stat& stat : set.by_pool) stat.allocated = stat.freed = 0;
    num_alloc_retries_ = num_ooms_ = num_device_alloc_ = num_device_free_ = 0;
  }

  // kStatCount x 3 pools x 4 fields, then retries, ooms, device allocs, device frees.
  void stats(int64_t* out) const {
    for (const StatSet& set : stats_)
      for (const Stat& stat : set.by_pool) {
        *out++ = stat.current;
        *out++ = stat.peak;
        *out++ = stat.allocated;
        *out++ = stat.freed;
      }
    *out++ = num_alloc_retries_;
    *out++ = num_ooms_;
    *out++ = num_device_alloc_;
    *out++ = num_device_free_;
  }

  // Every block in segment order, 7 values each: segment ordinal, segment address, segment
  // size, pool, block address, block size, requested | allocated << 63.  Returns the count
  // of blocks; writes at most `capacity` of them.
  uint64_t blocks(uint64_t* out, uint64_t capacity) const {
    uint64_t count = 0;
    for (size_t i = 0; i < segments_.size(); ++i) {
      const Segment* s = segments_[i];
      for (const Block* b = s->head; b != nullptr; b = b->next, ++count) {
        if (count >= capacity) continue;
        uint64_t* r = out + count * 7;
        r[0] = i;
        r[1] = s->address;
        r[2] = s->size;
        r[3] = static_cast<uint64_t>(s->pool);
        r[4] = b->address;
        r[5] = b->size;
        r[6] = b->requested | (static_cast<uint64_t>(b->allocated) << 63);
      }
    }
    return count;
  }

 private:
  using FreeKey = std::pair<uint64_t, uint64_t>;  // (size, address): best fit, lowest address

  void insert_free(Block* block) {
    free_[block->segment->pool].emplace(block->size, block->address);
    free_blocks_[block->address] = block;
  }

  void remove_free(Block* block) {
    free_[block->segment->pool].erase(FreeKey(block->size, block->address));
    free_blocks_.erase(block->address);
  }

  Block* best_fit(Pool pool, uint64_t size) {
    auto& entries = free_[pool];
    auto it = entries.lower_bound(FreeKey(size, 0));
    if (it == entries.end()) return nullptr;
    auto found = free_blocks_.find(it->second);
    Block* block = found->second;
    free_blocks_.erase(found);
    entries.erase(it);
    if (block->prev != nullptr || block->next != nullptr) {  // a free piece of a split segment
      stats_[kInactiveSplit].sub(pool, 1);
      stats_[kInactiveSplitBytes].sub(pool, static_cast<int64_t>(block->size));
    }
    return block;
  }

  int64_t reserved() const { return stats_[kReservedBytes].by_pool[0].current; }


  Block* new_segment(Pool pool, uint64_t size) {
    const uint64_t seg_size = segment_size(size);
    if (static_cast<uint64_t>(reserved()) + seg_size > limit_) {
      ++num_alloc_retries_;
      release_cached();
      if (static_cast<uint64_t>(reserved()) + seg_size > limit_) {
        ++num_ooms_;
        return nullptr;
      }
    }
    Segment* segment = new Segment{next_address_, seg_size, pool, nullptr};
    next_address_ += seg_size;
    Block* block = new Block(segment, segment->address, seg_size);
    segment->head = block;
    segments_.push_back(segment);
    ++num_device_alloc_;
    stats_[kSegment].add(pool, 1);
    stats_[kReservedBytes].add(pool, static_cast<int64_t>(seg_size));
    return block;
  }

  uint64_t total_memory_;
  uint64_t limit_;
  uint64_t next_address_;
  uint64_t next_handle_ = 1;
  std::vector<Segment*> segments_;
  std::set<FreeKey> free_[2];
  std::unordered_map<uint64_t, Block*> free_blocks_;
  std::unordered_map<uint64_t, Block*> handles_;
  StatSet stats_[kStatCount];
  int64_t num_alloc_retries_ = 0, num_ooms_ = 0, num_device_alloc_ = 0, num_device_free_ = 0;
};

}  // namespace fakegpu::allocator

using fakegpu::allocator::Model;

#define ALLOCATOR_MODEL_API extern "C" __attribute__((visibility("default")))

ALLOCATOR_MODEL_API void* fakegpu_alloc_model_new(int device, uint64_t total_memory) {
  return new Model(device, total_memory);
}
ALLOCATOR_MODEL_API void fakegpu_alloc_model_delete(void* model) { delete static_cast<Model*>(model); }
ALLOCATOR_MODEL_API uint64_t fakegpu_alloc_model_malloc(void* model, uint64_t nbytes) {
  return static_cast<Model*>(model)->malloc(nbytes);
}
ALLOCATOR_MODEL_API void fakegpu_alloc_model_free(void* model, uint64_t handle) {
  static_cast<Model*>(model)->free(handle);
}
ALLOCATOR_MODEL_API uint64_t fakegpu_alloc_model_block_size(void* model, uint64_t handle) {
  return static_cast<Model*>(model)->block_size(handle);
}
ALLOCATOR_MODEL_API void fakegpu_alloc_model_release_cached(void* model) {
  static_cast<Model*>(model)->release_cached();
}
ALLOCATOR_MODEL_API void fakegpu_alloc_model_reset_peak(void* model) { static_cast<Model*>(model)->reset_peak(); }
ALLOCATOR_MODEL_API void fakegpu_alloc_model_reset_accumulated(void* model) {
  static_cast<Model*>(model)->reset_accumulated();
}
ALLOCATOR_MODEL_API void fakegpu_alloc_model_stats(void* model, int64_t* out) { static_cast<Model*>(model)->stats(out); }
ALLOCATOR_MODEL_API uint64_t fakegpu_alloc_model_blocks(void* model, uint64_t* out, uint64_t capacity) {
  return static_cast<Model*>(model)->blocks(out, capacity);
}
ALLOCATOR_MODEL_API void fakegpu_alloc_model_set_limit(void* model, uint64_t limit) {
  static_cast<Model*>(model)->set_limit(limit);
}
ALLOCATOR_MODEL_API uint64_t fakegpu_alloc_round_size(uint64_t nbytes) {
  return fakegpu::allocator::round_size(nbytes);
}
ALLOCATOR_MODEL_API uint64_t fakegpu_alloc_segment_size(uint64_t rounded) {
  return fakegpu::allocator::segment_size(rounded);
}
