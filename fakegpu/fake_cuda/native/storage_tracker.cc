// Per-device memory accounting of fake CUDA devices, in C++, below Python.
//
// fakegpu's fake CUDA tensors are CPU tensors; a storage "is on cuda:k" when it was made
// there (a factory or a copy aimed at cuda:k) or by an op whose inputs are there.  Watching
// every aten op from a Python TorchDispatchMode costs about 20 us per op (the mode machinery
// itself, measured with a mode that does nothing), which doubles the step time of models
// made of small ops.  This file does the same job from a boxed C++ fallback on a dispatch
// key that the tracked threads include in their thread-local key set, at about 1 us per op.
//
// It is compiled against the installed torch at first use (fakegpu/fake_cuda/tracker.py) and
// loaded by path; without a compiler the Python mode (memory.py) does the job instead.
//
// What it does per op (the fallback sits above autograd, so it sees the ops user code and
// autograd's backward formulas call, and the ops those ops call in turn):
//   - a `device` argument naming cuda:k (code that reached aten without passing the Python
//     API's device rewrite) becomes the CPU, and the op's new storages belong to k;
//   - otherwise the op runs on the device of its first input whose storage is tracked, or on
//     the device the Python side named for this thread (factories aimed at cuda:k);
//   - each output storage not seen before is charged to that device's caching-allocator
//     model (native/src/allocator/caching_allocator_model.cc, reached through function
//     pointers the Python side hands over), and its DataPtr's deleter is wrapped so that the
//     block is freed when the storage's memory is.
// A storage charged that would not fit raises torch.OutOfMemoryError from the op.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/impl/PyObjectSlot.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

constexpr c10::DispatchKey kTrackingKey = c10::DispatchKey::TESTING_ONLY_GenericMode;

using ModelMalloc = uint64_t (*)(void* model, uint64_t nbytes);
using ModelFree = void (*)(void* model, uint64_t handle);
// Formats the out-of-memory message for (device, nbytes) into buffer; returns its length.
using OomMessage = int (*)(int device, uint64_t nbytes, char* buffer, int capacity);
// Writes the StorageImpl addresses of a wrapper subclass's inner tensors (the PyObject at
// `object`) into `out`; returns how many (-1 on a Python error).
using SubclassStorages = int (*)(uintptr_t object, uintptr_t* out, int capacity);
constexpr int kMaxInnerStorages = 16;

struct Charged {
  c10::StorageImpl* storage;
  int device;
  uint64_t handle;
  c10::DeleterFnPtr original_deleter;
};

struct Tracker {
  std::mutex mutex;
  std::unordered_map<void*, Charged> by_context;              // DataPtr context -> charge
  std::unordered_map<const c10::StorageImpl*, void*> by_storage;  // storage -> DataPtr context
  std::vector<void*> models;                                   // per fake device
  ModelMalloc model_malloc = nullptr;
  ModelFree model_free = nullptr;
  OomMessage oom_message = nullptr;
  std::atomic<SubclassStorages> subclass_storages{nullptr};  // read outside the mutex
  bool stopped = false;  // the models are gone (interpreter exit): frees only free memory
};

// Leaked on purpose: storages die during interpreter and static teardown, after any static
// object here would have been destroyed, and their deleters still come through here.
Tracker& tracker() {
  static Tracker* instance = new Tracker();
  return *instance;
}

thread_local int tls_target = -1;       // the device factories of this thread aim at
thread_local int tls_current = 0;       // torch.cuda.current_device() of this thread

void tracked_deleter(void* context) {
  Tracker& t = tracker();
  c10::DeleterFnPtr original = nullptr;
  {
    std::lock_guard<std::mutex> lock(t.mutex);
    auto it = t.by_context.find(context);
    if (it != t.by_context.end()) {
      original = it->second.original_deleter;
      if (!t.stopped && it->second.handle != 0) {
        t.model_free(t.models[it->second.device], it->second.handle);
      }
      t.by_storage.erase(it->second.storage);
      t.by_context.erase(it);
    }
  }
  if (original != nullptr) {
    original(context);
  }
}

// -1: not tracked.
int device_of_locked(Tracker& t, const c10::StorageImpl* storage) {
  auto it = t.by_storage.find(storage);
  if (it == t.by_storage.end()) return -1;
  return t.by_context.find(it->second)->second.device;
}

// A CPU storage with memory of its own.  Tracing (dynamo's fake tensors) makes storages of a
// symbolic size, whose nbytes() throws: never ours.
bool trackable(const c10::StorageImpl* storage) {
  return storage != nullptr && storage->device_type() == c10::DeviceType::CPU &&
         storage->data_ptr().get_context() != nullptr && !storage->sym_nbytes().is_heap_allocated() &&
         storage->nbytes() > 0;
}

enum class ChargeResult { kCharged, kAlready, kUntrackable, kOutOfMemory };

ChargeResult charge_locked(Tracker& t, c10::StorageImpl* storage, int device) {
  if (!trackable(storage)) return ChargeResult::kUntrackable;
  if (t.by_storage.count(storage) != 0) return ChargeResult::kAlready;
  if (device < 0 || device >= static_cast<int>(t.models.size())) return ChargeResult::kUntrackable;
  c10::DataPtr& data = storage->_mutable_data_ptr_no_checks();
  c10::DeleterFnPtr original = data.get_deleter();
  if (original == &tracked_deleter) return ChargeResult::kAlready;
  void* context = data.get_context();
  if (t.by_context.count(context) != 0) return ChargeResult::kUntrackable;  // a shared context
  uint64_t handle = t.model_malloc(t.models[device], storage->nbytes());
  if (handle == 0) return ChargeResult::kOutOfMemory;
  if (!data.compare_exchange_deleter(original, &tracked_deleter)) {
    t.model_free(t.models[device], handle);
    return ChargeResult::kUntrackable;
  }
  t.by_context.emplace(context, Charged{storage, device, handle, original});
  t.by_storage.emplace(storage, context);
  return ChargeResult::kCharged;
}

[[noreturn]] void raise_out_of_memory(int device, uint64_t nbytes) {
  char buffer[1024];
  int length = tracker().oom_message(device, nbytes, buffer, sizeof(buffer));
  std::string message(buffer, length > 0 ? std::min<int>(length, sizeof(buffer)) : 0);
  TORCH_CHECK_WITH(OutOfMemoryError, false, message);
}

void charge_or_raise(Tracker& t, c10::StorageImpl* storage, int device) {
  ChargeResult result;
  {
    std::lock_guard<std::mutex> lock(t.mutex);
    result = charge_locked(t, storage, device);
  }
  if (result == ChargeResult::kOutOfMemory) raise_out_of_memory(device, storage->nbytes());
}

c10::StorageImpl* storage_of(const at::Tensor& tensor) {
  if (!tensor.defined() || tensor.layout() != c10::kStrided || !tensor.has_storage()) return nullptr;
  return tensor.storage().unsafeGetStorageImpl();
}

// The storages that hold a tensor's memory: its own, or for a wrapper subclass (DTensor and
// other tensors with __torch_dispatch__, whose own storage holds nothing) those of its inner
// tensors, which the Python side lists (__tensor_flatten__).  A subclass's dispatch runs its
// inner ops with every key above Python excluded, this one too, so the tracker never sees
// them: the outer op's inputs and outputs are where its memory shows (as in the Python mode).
// The visitor returns true to go on and false to stop: finding a device needs only the first
// tracked storage, and a foreach op's Tensor[] of DTensors would otherwise cost one Python
// callback per element after the answer is known.  Both walks return false once stopped.
template <typename Visit>
bool visit_storages(Tracker& t, const at::Tensor& tensor, Visit&& visit) {
  c10::StorageImpl* own = storage_of(tensor);
  if (own != nullptr && trackable(own)) return visit(own);
  if (!tensor.defined() || !tensor.key_set().has(c10::DispatchKey::Python)) return true;
  SubclassStorages inner_storages = t.subclass_storages.load();
  if (inner_storages == nullptr) return true;
  PyObject* object = tensor.unsafeGetTensorImpl()->pyobj_slot()->load_pyobj();
  if (object == nullptr) return true;
  uintptr_t inner[kMaxInnerStorages];
  const int count = inner_storages(reinterpret_cast<uintptr_t>(object), inner, kMaxInnerStorages);
  for (int i = 0; i < count; ++i) {
    if (!visit(reinterpret_cast<c10::StorageImpl*>(inner[i]))) return false;
  }
  return true;
}

// Each storage of an argument or a result: a tensor, a Tensor[] or a Tensor?[].
template <typename Visit>
bool visit_value_storages(Tracker& t, const c10::IValue& value, Visit&& visit) {
  if (value.isTensor()) return visit_storages(t, value.toTensor(), visit);
  if (value.isTensorList()) {
    for (const at::Tensor& tensor : value.toTensorList()) {
      if (!visit_storages(t, tensor, visit)) return false;
    }
  } else if (value.isList()) {
    for (const c10::IValue& item : value.toListRef()) {
      if (item.isTensor() && !visit_storages(t, item.toTensor(), visit)) return false;
    }
  }
  return true;
}

int device_of(Tracker& t, const c10::StorageImpl* storage) {
  std::lock_guard<std::mutex> lock(t.mutex);
  return device_of_locked(t, storage);
}

// The device of the first input whose storage is tracked, -1 if none.
int first_device(Tracker& t, const torch::jit::Stack& stack, size_t begin, size_t end) {
  {
    std::lock_guard<std::mutex> lock(t.mutex);
    if (t.by_storage.empty()) return -1;
  }
  int device = -1;
  for (size_t i = begin; i < end && device < 0; ++i) {
    visit_value_storages(t, stack[i], [&](const c10::StorageImpl* storage) {
      device = device_of(t, storage);
      return device < 0;
    });
  }
  return device;
}

bool returns_only_aliases(const c10::FunctionSchema& schema) {
  const auto& returns = schema.returns();
  if (returns.empty()) return true;
  for (const auto& ret : returns) {
    if (ret.alias_info() == nullptr) return false;
  }
  return true;
}

void charge_outputs(Tracker& t, torch::jit::Stack& stack, size_t begin, int device) {
  for (size_t i = begin; i < stack.size(); ++i) {
    visit_value_storages(t, stack[i], [&](c10::StorageImpl* storage) {
      charge_or_raise(t, storage, device);
      return true;
    });
  }
}

void tracking_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                       torch::jit::Stack* stack) {
  const c10::FunctionSchema& schema = op.schema();
  const size_t arguments = schema.arguments().size();
  const size_t begin = stack->size() - arguments;
  int device = tls_target;
  // A cuda device that reached aten: the CPU all the same, and the outputs are on it.
  for (size_t i = 0; i < arguments; ++i) {
    c10::IValue& value = (*stack)[begin + i];
    if (value.isDevice() && value.toDevice().is_cuda()) {
      c10::Device cuda = value.toDevice();
      device = cuda.has_index() ? cuda.index() : tls_current;
      value = c10::IValue(c10::Device(c10::DeviceType::CPU));
    }
  }
  Tracker& t = tracker();
  const bool aliases = returns_only_aliases(schema);
  if (device < 0 && !aliases) device = first_device(t, *stack, begin, begin + arguments);
  // The ops this op calls inside (a composite op's pieces, a kernel's own allocations) pass
  // through here too: their temporaries are charged as the Python mode, which sits below
  // autograd, charges them.  A subclass's inner ops do not (see visit_storages).
  op.redispatchBoxed(keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kTrackingKey),
                     stack);
  if (device < 0 || aliases) return;
  const size_t outputs = schema.returns().size();
  charge_outputs(t, *stack, stack->size() - outputs, device);
}

}  // namespace

TORCH_LIBRARY_IMPL(_, TESTING_ONLY_GenericMode, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&tracking_fallback>());
}

extern "C" {

// The dispatch key's number (torch._C.DispatchKey(n)), for the Python side's
// higher-order operators, which must pass over it.
int fakegpu_tracker_dispatch_key() { return static_cast<int>(kTrackingKey); }

void fakegpu_tracker_configure(uintptr_t model_malloc, uintptr_t model_free, uintptr_t oom_message,
                               uintptr_t subclass_storages) {
  Tracker& t = tracker();
  std::lock_guard<std::mutex> lock(t.mutex);
  t.model_malloc = reinterpret_cast<ModelMalloc>(model_malloc);
  t.model_free = reinterpret_cast<ModelFree>(model_free);
  t.oom_message = reinterpret_cast<OomMessage>(oom_message);
  t.subclass_storages.store(reinterpret_cast<SubclassStorages>(subclass_storages));
}

int fakegpu_tracker_add_device(void* model) {
  Tracker& t = tracker();
  std::lock_guard<std::mutex> lock(t.mutex);
  t.models.push_back(model);
  return static_cast<int>(t.models.size()) - 1;
}

// Track (or stop tracking) the ops of the calling thread.
void fakegpu_tracker_enable_thread(int enabled) {
  c10::impl::tls_set_dispatch_key_included(kTrackingKey, enabled != 0);
}

int fakegpu_tracker_thread_enabled() {
  return c10::impl::tls_is_dispatch_key_included(kTrackingKey) ? 1 : 0;
}

// Returns the previous target (-1: none).
int fakegpu_tracker_set_target(int device) {
  int previous = tls_target;
  tls_target = device;
  return previous;
}

int fakegpu_tracker_target() { return tls_target; }

void fakegpu_tracker_set_current(int device) { tls_current = device; }

// 0 charged or already tracked, 1 untrackable (not a CPU storage with memory), 2 out of memory.
int fakegpu_tracker_charge(void* storage, int device) {
  Tracker& t = tracker();
  std::lock_guard<std::mutex> lock(t.mutex);
  switch (charge_locked(t, static_cast<c10::StorageImpl*>(storage), device)) {
    case ChargeResult::kCharged:
    case ChargeResult::kAlready:
      return 0;
    case ChargeResult::kUntrackable:
      return 1;
    case ChargeResult::kOutOfMemory:
      return 2;
  }
  return 1;
}

int fakegpu_tracker_device_of(void* storage) {
  Tracker& t = tracker();
  std::lock_guard<std::mutex> lock(t.mutex);
  return device_of_locked(t, static_cast<const c10::StorageImpl*>(storage));
}

uint64_t fakegpu_tracker_count() {
  Tracker& t = tracker();
  std::lock_guard<std::mutex> lock(t.mutex);
  return t.by_storage.size();
}

// The models are about to go away (interpreter exit): later frees only free host memory,
// and no op calls back into an interpreter that is shutting down.
void fakegpu_tracker_stop() {
  Tracker& t = tracker();
  std::lock_guard<std::mutex> lock(t.mutex);
  t.stopped = true;
  t.subclass_storages.store(nullptr);
}

}  // extern "C"
