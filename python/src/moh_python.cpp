// moh._core: moh's layers, configs, KV caches and routing records for Python (pybind11).
//
// Arrays in, arrays out: x, memory, masks and biases are NumPy arrays or CPU torch tensors; a
// C-contiguous array of the layer's dtype is read in place (no copy), anything else of that dtype
// is copied once (counted by input_copies()), another dtype is a ValueError. The result has the
// type of x (a torch tensor for a torch x, sharing the NumPy result's memory). The GIL is
// released while a layer computes, so Python threads can run layers at once; each call borrows a
// moh::Workspace from the layer's own free list, so a warm call needs no new scratch for the
// layer's work (its result, and a few small objects of the call, are still allocated). A KV
// cache or routing record in use by a call is refused to every other call and accessor until
// that call returns. moh::Error becomes ValueError (moh.Error, a subclass) with the same message.
// The pure-Python parts (from_torch, the package's docs) are in python/moh/.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <sstream>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

#include <moh/io.hpp>
#include <moh/moh.hpp>

namespace py = pybind11;

namespace {

using moh::Index;

std::atomic<long long> g_input_copies{0};
std::atomic<std::uintptr_t> g_last_input{0};  // data of the last call's x, for the zero-copy test

bool aligned(const py::array& a) {
  return (a.flags() & py::detail::npy_api::NPY_ARRAY_ALIGNED_) != 0;
}

template <class T>
const char* dtype_name() {
  return std::is_same<T, float>::value ? "float32" : "float64";
}

/// A moh::Error worded as the library words its own ("moh: " first).
[[noreturn]] void fail(const std::string& message) { moh::detail::fail(message); }

std::string shape_of(const py::array& a) {
  std::ostringstream s;
  s << '[';
  for (py::ssize_t i = 0; i < a.ndim(); ++i) s << (i ? ", " : "") << a.shape(i);
  s << ']';
  return s.str();
}

std::string type_name(py::handle o) { return py::str(py::type::of(o).attr("__name__")); }

// ---- torch tensors ------------------------------------------------------------------------------

/// Whether `o` is a torch.Tensor (torch is not imported here: a tensor exists only once it is).
bool is_torch_tensor(py::handle o) {
  const py::dict modules = py::module_::import("sys").attr("modules");
  if (!modules.contains("torch")) return false;
  return py::isinstance(o, modules["torch"].attr("Tensor"));
}

/// The NumPy view of a CPU torch tensor (shares its memory), detached from autograd.
py::object torch_to_numpy(py::handle t, const std::string& what) {
  const std::string device = py::str(t.attr("device").attr("type"));
  if (device != "cpu")
    fail(what + ": expected a CPU tensor, got a tensor on '" + device +
         "' (move it with .cpu() first)");
  try {
    return t.attr("detach")().attr("numpy")();
  } catch (py::error_already_set& e) {
    fail(what + ": expected a tensor NumPy can view (float32, float64 or bool), got dtype " +
         std::string(py::str(t.attr("dtype"))) + " (" + e.what() + ")");
  }
}

py::object numpy_to_torch(const py::object& a) {
  return py::module_::import("torch").attr("from_numpy")(a);
}

// ---- arrays in ----------------------------------------------------------------------------------

/// An input of `what` as a C-contiguous array of T with `ndim` axes: read in place when it
/// already is one; copied (and counted) when it has T but another layout; an error otherwise.
template <class T>
py::array_t<T, py::array::c_style> input_array(py::handle o, const std::string& what, int ndim,
                                               bool* was_torch = nullptr,
                                               const char* axes = nullptr) {
  py::object obj = py::reinterpret_borrow<py::object>(o);
  if (is_torch_tensor(obj)) {
    obj = torch_to_numpy(obj, what);
    if (was_torch) *was_torch = true;
  } else if (!py::isinstance<py::array>(obj)) {
    fail(what + ": expected a NumPy array or a torch tensor of " + dtype_name<T>() +
         ", got " + type_name(obj));
  }
  const py::array a = obj;
  if (!py::isinstance<py::array_t<T>>(a))
    fail(what + ": expected " + dtype_name<T>() + " values (the layer's dtype), got " +
         std::string(py::str(a.dtype())));
  if (a.ndim() != ndim)
    fail(what + ": expected " + std::to_string(ndim) + " axes" +
         (axes ? std::string(" ") + axes : std::string()) + ", got shape " + shape_of(a));
  if (py::isinstance<py::array_t<T, py::array::c_style>>(a) && aligned(a))
    return py::reinterpret_borrow<py::array_t<T, py::array::c_style>>(a);
  ++g_input_copies;  // another layout, or not aligned for T: one copy
  return py::array_t<T, py::array::c_style>::ensure(a);
}

/// A [batch, tokens] padding mask (bool, True = padding).
py::array_t<bool, py::array::c_style> mask_array(py::handle o, const std::string& what) {
  py::object obj = py::reinterpret_borrow<py::object>(o);
  if (is_torch_tensor(obj)) obj = torch_to_numpy(obj, what);
  if (!py::isinstance<py::array>(obj))
    fail(what + ": expected a bool NumPy array or torch tensor, got " + type_name(obj));
  const py::array a = obj;
  if (!py::isinstance<py::array_t<bool>>(a))
    fail(what + ": expected bool values (True = padding), got " + std::string(py::str(a.dtype())));
  if (a.ndim() != 2) fail(what + ": expected 2 axes [batch, tokens], got shape " + shape_of(a));
  if (py::isinstance<py::array_t<bool, py::array::c_style>>(a) && aligned(a))
    return py::reinterpret_borrow<py::array_t<bool, py::array::c_style>>(a);
  ++g_input_copies;
  return py::array_t<bool, py::array::c_style>::ensure(a);
}

/// An array the call writes into: C-contiguous, writeable, of T, exactly `shape`.
template <class T>
py::array_t<T, py::array::c_style> output_array(py::handle o, const std::string& what,
                                                const std::vector<Index>& shape) {
  py::object obj = py::reinterpret_borrow<py::object>(o);
  if (is_torch_tensor(obj)) {
    if (obj.attr("requires_grad").cast<bool>())
      fail(what + ": expected a tensor without requires_grad (moh writes it outside autograd), "
           "got one that requires grad");
    obj = torch_to_numpy(obj, what);
  }
  std::ostringstream want;
  want << '[';
  for (std::size_t i = 0; i < shape.size(); ++i) want << (i ? ", " : "") << shape[i];
  want << ']';
  if (!py::isinstance<py::array_t<T, py::array::c_style>>(obj))
    fail(what + ": expected a C-contiguous " + dtype_name<T>() + " array of shape " + want.str() +
         " to write into, got " +
         (py::isinstance<py::array>(obj)
              ? std::string(py::str(py::array(obj).dtype())) + " array of shape " +
                    shape_of(py::array(obj)) +
                    (py::array(obj).flags() & py::array::c_style ? "" : " (not C-contiguous)")
              : type_name(obj)));
  auto a = py::reinterpret_borrow<py::array_t<T, py::array::c_style>>(obj);
  if (!a.writeable()) fail(what + ": expected a writeable array, got a read-only one");
  if (!aligned(a)) fail(what + ": expected an array aligned for " + dtype_name<T>() + ", got a misaligned one");
  bool same = a.ndim() == static_cast<py::ssize_t>(shape.size());
  for (std::size_t i = 0; same && i < shape.size(); ++i) same = a.shape(i) == shape[i];
  if (!same) fail(what + ": expected shape " + want.str() + ", got " + shape_of(a));
  return a;
}

template <class T>
moh::ConstTensorMap3<T> map3(const py::array_t<T, py::array::c_style>& a) {
  return moh::ConstTensorMap3<T>(a.data(), a.shape(0), a.shape(1), a.shape(2));
}

/// An integer option or field (a Python int, or anything with __index__ such as numpy.int64).
bool is_bool(py::handle v) {  // True/False or numpy.bool_
  return py::isinstance<py::bool_>(v) || type_name(v) == "bool_";
}

Index integer(py::handle v, const std::string& where) {
  if (is_bool(v) || !PyIndex_Check(v.ptr()))
    fail(where + ": expected an integer, got " + type_name(v));
  const py::int_ i(py::reinterpret_borrow<py::object>(v));
  int overflow = 0;
  const long long n = PyLong_AsLongLongAndOverflow(i.ptr(), &overflow);
  if (overflow != 0)
    fail(where + ": expected an integer of at most 64 bits, got " + std::string(py::str(py::object(i))));
  return static_cast<Index>(n);
}

bool flag(py::handle v, const std::string& where) {
  if (!is_bool(v)) fail(where + ": expected True or False, got " + type_name(v));
  return PyObject_IsTrue(v.ptr()) == 1;
}

double number(py::handle v, const std::string& where) {
  if (is_bool(v) || !(PyFloat_Check(v.ptr()) || PyIndex_Check(v.ptr()) ||
                      py::hasattr(v, "__float__")))
    fail(where + ": expected a number, got " + type_name(v));
  return py::float_(py::reinterpret_borrow<py::object>(v)).cast<double>();
}

/// A path argument: a str or an os.PathLike (pathlib.Path).
std::string path_of(py::handle p, const char* where) {
  if (!py::isinstance<py::str>(p) && !py::hasattr(p, "__fspath__"))
    fail(std::string(where) + ": path: expected a str or os.PathLike, got " + type_name(p));
  return py::module_::import("os").attr("fspath")(p).cast<std::string>();
}

// ---- thread pools -------------------------------------------------------------------------------

/// The pools of threads= calls, created on first use and kept for the process. A child process
/// made by fork() has none of their threads: it forgets them (after_fork_in_child), leaking
/// their memory rather than joining threads that do not exist there.
struct SharedPools {
  std::mutex mutex;
  std::map<int, std::unique_ptr<moh::ThreadPool>> pools;
};
SharedPools* g_pools = new SharedPools;  // never destroyed: pools outlive every call

void after_fork_in_child() {
  for (auto& entry : g_pools->pools) entry.second.release();  // their threads are gone
  g_pools = new SharedPools;  // the old mutex may have been held by a thread of the parent
}

constexpr Index kMaxThreads = 1024;

/// The pool of `threads` threads for a call (null for 1: the calling thread).
moh::ThreadPool* shared_pool(py::handle threads, const std::string& where) {
  const Index n = integer(threads, where + ": threads");
  if (n < 1 || n > kMaxThreads)
    fail(where + ": threads: expected 1.." + std::to_string(kMaxThreads) + ", got " + std::to_string(n));
  if (n == 1) return nullptr;
  SharedPools& g = *g_pools;
  const std::lock_guard<std::mutex> lock(g.mutex);
  auto& p = g.pools[static_cast<int>(n)];
  if (!p) p = std::make_unique<moh::ThreadPool>(static_cast<int>(n));
  return p.get();
}

/// Marks a cache or routing record as used by the running call (checked and set with the GIL
/// held): every other call and accessor refuses it until the call returns.
class InUse {
 public:
  InUse(bool& busy, const std::string& what) : busy_(busy) {
    if (busy_)
      fail(what + ": expected an object no other call is using, got one in use by a call on "
           "another thread");
    busy_ = true;
  }
  ~InUse() { busy_ = false; }
  InUse(const InUse&) = delete;
  InUse& operator=(const InUse&) = delete;

 private:
  bool& busy_;
};

// ---- routing records and caches -----------------------------------------------------------------

/// A routing record of either dtype: filled by the layer it is passed to.
template <template <class> class R>
struct Routing {
  std::variant<R<float>, R<double>> record;
  bool busy = false;  // a call is filling it
  std::variant<R<float>, R<double>>& read(const char* what) {
    if (busy)
      fail(std::string(what) + ": expected a record no call is filling, got one a call on another "
           "thread is filling");
    return record;
  }
  template <class T>
  R<T>& as() {
    if (!std::holds_alternative<R<T>>(record)) record = R<T>();
    return std::get<R<T>>(record);
  }
};
using PyMoHRouting = Routing<moh::MoHRouting>;
using PyMoARouting = Routing<moh::MoARouting>;

template <class M>
py::array matrix_array(const M& m) {  // a copy, row-major [rows, cols]
  using S = typename M::Scalar;
  py::array_t<S> a({static_cast<py::ssize_t>(m.rows()), static_cast<py::ssize_t>(m.cols())});
  std::copy(m.data(), m.data() + m.size(), a.mutable_data());
  return std::move(a);
}
template <class V>
py::array vector_array(const V& v) {
  using S = typename V::value_type;
  py::array_t<std::int64_t> a(static_cast<py::ssize_t>(v.size()));
  for (std::size_t i = 0; i < v.size(); ++i) a.mutable_data()[i] = static_cast<S>(v[i]);
  return std::move(a);
}

/// A KV cache (or memory cache) of either dtype, made by a layer of that dtype.
struct PyKvCache {
  std::variant<moh::KvCache<float>, moh::KvCache<double>> cache;
  bool busy = false;  // a call is reading or extending it
  template <class T>
  moh::KvCache<T>& as(const char* layer) {
    auto* c = std::get_if<moh::KvCache<T>>(&cache);
    if (!c)
      fail(std::string(layer) + ": cache: expected a cache of " + dtype_name<T>() +
           " (made by this layer's make_cache), got one of " +
           (std::holds_alternative<moh::KvCache<float>>(cache) ? "float32" : "float64"));
    return *c;
  }
  template <class F>
  decltype(auto) visit(F&& f) {
    if (busy)
      fail("KvCache: expected a cache no call is using, got one in use by a call on another "
           "thread");
    return std::visit(std::forward<F>(f), cache);
  }
};

moh::CacheStorage cache_storage(py::handle v, const std::string& where) {
  if (py::isinstance<moh::CacheStorage>(v)) return v.cast<moh::CacheStorage>();
  if (py::isinstance<py::str>(v)) {
    const std::string s = v.cast<std::string>();
    if (s == "native") return moh::CacheStorage::Native;
    if (s == "bfloat16") return moh::CacheStorage::BFloat16;
  }
  fail(where + ": storage: expected moh.CacheStorage.Native or .BFloat16 ('native', 'bfloat16'), "
       "got " + std::string(py::repr(v)));
}

// ---- configs ------------------------------------------------------------------------------------

template <class Enum>
Enum parse_enum_name(const std::string& s, const char* what) {
  Enum e{};
  if (!moh::detail::parse_enum(s, e))
    fail(std::string(what) + ": expected one of " + moh::detail::enum_list<Enum>() + ", got '" + s +
         "'");
  return e;
}

template <class C>
std::string field_names() {
  std::string out;
  C c;
  C::fields(c, [&](const char* key, auto&) { out += (out.empty() ? "" : ", ") + std::string(key); });
  return out;
}

/// Sets config field `key` from a Python value (an enum field also takes its name as a string).
template <class C>
void set_field(C& c, const std::string& key, py::handle value) {
  bool found = false;
  C::fields(c, [&](const char* k, auto& field) {
    if (key != k) return;
    found = true;
    using F = std::decay_t<decltype(field)>;
    const std::string where = std::string(C::kLayer) + " config: " + key;
    if constexpr (std::is_enum<F>::value) {
      if (py::isinstance<py::str>(value))
        field = parse_enum_name<F>(value.cast<std::string>(), where.c_str());
      else if (py::isinstance<F>(value))
        field = value.cast<F>();
      else
        fail(where + ": expected one of " + moh::detail::enum_list<F>() + ", got " +
             type_name(value));
    } else if constexpr (std::is_same<F, bool>::value) {
      field = flag(value, where);
    } else if constexpr (std::is_integral<F>::value) {
      field = static_cast<F>(integer(value, where));
    } else {
      field = static_cast<F>(number(value, where));
    }
  });
  if (!found)
    fail(std::string(C::kLayer) + " config: unknown field '" + key + "': expected one of " +
         field_names<C>());
}

template <class C>
py::dict config_dict(const C& c) {
  py::dict d;
  C::fields(const_cast<C&>(c), [&](const char* key, auto& field) { d[key] = py::cast(field); });
  return d;
}

/// The property `key` of a config class, a field of type F.
template <class C, class F>
void def_field(py::class_<C>& cls, const char* key) {
  const std::string k = key;
  cls.def_property(
      key,
      [k](const C& c) {
        F out{};
        C::fields(const_cast<C&>(c), [&](const char* kk, auto& f) {
          if constexpr (std::is_same<std::decay_t<decltype(f)>, F>::value)
            if (k == kk) out = f;
        });
        return out;
      },
      [k](C& c, py::handle v) { set_field(c, k, v); });
}

template <class C>
py::class_<C> bind_config(py::module_& m, const char* name, const char* doc) {
  py::class_<C> cls(m, name, doc);
  cls.def(py::init([](const py::kwargs& kw) {
            C c;
            for (auto item : kw) set_field(c, item.first.cast<std::string>(), item.second);
            return c;
          }),
          "A config with the given fields set (keyword arguments, C++ names); the rest default.");
  C probe;
  C::fields(probe, [&](const char* key, auto& field) {
    def_field<C, std::decay_t<decltype(field)>>(cls, key);
  });
  cls.def("validate", &C::validate, "Raises moh.Error (ValueError) on impossible settings.");
  cls.def("to_dict", &config_dict<C>, "The fields as a dict (enums as moh enums).");
  cls.def("__repr__", [name](const C& c) {
    std::string s = std::string(name) + "(";
    bool first = true;
    C::fields(const_cast<C&>(c), [&](const char* key, auto& field) {
      s += (first ? "" : ", ") + std::string(key) + "=" + std::string(py::repr(py::cast(field)));
      first = false;
    });
    return s + ")";
  });
  cls.def(
      "__eq__",
      [](const C& a, const C& b) {
        return config_dict(a).attr("__eq__")(config_dict(b)).template cast<bool>();
      },
      py::is_operator());
  cls.def(py::pickle([](const C& c) { return config_dict(c); },
                     [](const py::dict& d) {
                       C c;
                       for (auto item : d) set_field(c, item.first.cast<std::string>(), item.second);
                       return c;
                     }));
  return cls;
}

// ---- layers -------------------------------------------------------------------------------------

enum class Entry { Self, Cross, CrossCache, Cached };

/// A layer of either dtype and the workspaces its calls borrow.
template <template <class> class L>
class PyLayer {
 public:
  using Config = typename L<float>::Config;
  using F32 = L<float>;
  using F64 = L<double>;

  PyLayer(const Config& c, const py::object& seed, bool zero, const std::string& dtype) {
    if (!seed.is_none() && zero) fail(std::string(F32::kName) + ": expected a seed or "
                                      "zero_weights=True, got both");
    auto build = [&](auto tag) {
      using Layer = typename decltype(tag)::type;
      if (zero) return std::make_shared<Layer>(c, moh::zero_weights);
      if (!seed.is_none()) {
        const Index s = integer(seed, std::string(F32::kName) + ": seed");
        if (s < 0) fail(std::string(F32::kName) + ": seed: expected >= 0, got " + std::to_string(s));
        return std::make_shared<Layer>(c, static_cast<std::uint64_t>(s));
      }
      return std::make_shared<Layer>(c);
    };
    if (dtype == "float32")
      impl_ = build(type_tag<F32>{});
    else if (dtype == "float64")
      impl_ = build(type_tag<F64>{});
    else
      fail(std::string(F32::kName) + ": dtype: expected 'float32' or 'float64', got '" + dtype + "'");
  }
  template <class T>
  explicit PyLayer(L<T> layer) : impl_(std::make_shared<L<T>>(std::move(layer))) {}

  template <class F>
  decltype(auto) visit(F&& f) const {
    return std::visit([&](const auto& p) -> decltype(auto) { return f(*p); }, impl_);
  }
  template <class F>
  decltype(auto) visit_mut(F&& f) {
    return std::visit([&](auto& p) -> decltype(auto) { return f(*p); }, impl_);
  }
  std::string dtype() const { return std::holds_alternative<std::shared_ptr<F32>>(impl_) ? "float32" : "float64"; }

  /// A workspace for one call, given back when the lease ends.
  class Lease {
   public:
    explicit Lease(const PyLayer& l) : layer_(l) {
      const std::lock_guard<std::mutex> lock(l.mutex_);
      if (l.free_.empty()) {
        ws_ = std::make_unique<moh::Workspace>();
      } else {
        ws_ = std::move(l.free_.back());
        l.free_.pop_back();
      }
    }
    ~Lease() {
      const std::lock_guard<std::mutex> lock(layer_.mutex_);
      layer_.free_.push_back(std::move(ws_));
    }
    moh::Workspace* get() { return ws_.get(); }

   private:
    const PyLayer& layer_;
    std::unique_ptr<moh::Workspace> ws_;
  };

 private:
  template <class X>
  struct type_tag {
    using type = X;
  };
  std::variant<std::shared_ptr<F32>, std::shared_ptr<F64>> impl_;
  mutable std::mutex mutex_;
  mutable std::vector<std::unique_ptr<moh::Workspace>> free_;

 public:
  /// Calls and weight reads hold it shared, weight changes exclusively, always with the GIL
  /// released and let go of before the GIL is taken back, so no thread ever holds one while
  /// waiting for the other.
  mutable std::shared_mutex weights_mutex;
};

/// The keyword options of a call (ForwardOptions' fields, need_weights, routing, threads, out).
const std::vector<std::string>& call_options() {
  static const std::vector<std::string> names = {
      "key_padding_mask", "new_token_padding_mask", "query_padding_mask", "causal", "attn_bias",
      "attention_weights", "need_weights", "grid", "mode", "position_offset", "routing", "threads",
      "pool", "out"};
  return names;
}

moh::Causal parse_causal(py::handle v, const std::string& where) {
  if (v.is_none()) return moh::Causal::Auto;
  if (py::isinstance<py::bool_>(v)) return v.cast<bool>() ? moh::Causal::On : moh::Causal::Off;
  if (py::isinstance<moh::Causal>(v)) return v.cast<moh::Causal>();
  if (py::isinstance<py::str>(v)) {
    const std::string s = v.cast<std::string>();
    if (s == "auto") return moh::Causal::Auto;
    if (s == "on") return moh::Causal::On;
    if (s == "off") return moh::Causal::Off;
  }
  fail(where + ": causal: expected None/'auto', True/'on', False/'off' or a moh.Causal, got " +
       std::string(py::repr(v)));
}

moh::ComputeMode parse_mode(py::handle v, const std::string& where) {
  if (v.is_none()) return moh::ComputeMode::Auto;
  if (py::isinstance<moh::ComputeMode>(v)) return v.cast<moh::ComputeMode>();
  if (py::isinstance<py::str>(v)) {
    const std::string s = v.cast<std::string>();
    if (s == "auto") return moh::ComputeMode::Auto;
    if (s == "sparse") return moh::ComputeMode::Sparse;
    if (s == "dense") return moh::ComputeMode::Dense;
  }
  fail(where + ": mode: expected 'auto', 'sparse', 'dense' or a moh.ComputeMode, got " +
       std::string(py::repr(v)));
}

template <class Layer>
constexpr bool kIsMoA = std::is_same<typename Layer::Config, moh::MoAConfig>::value;
template <class Layer>
constexpr bool kIsMoH = std::is_same<typename Layer::Config, moh::MoHConfig>::value;

/// Heads of the attention probabilities a layer writes.
template <class Layer>
Index probability_heads(const Layer& layer) {
  if constexpr (kIsMoA<Layer>)
    return layer.config().top_k * layer.config().kv_heads();
  else
    return layer.num_heads();
}

/// One call of a layer: parses the options, runs it with the GIL released, returns y (and the
/// probabilities when need_weights=True).
template <class Layer, class Outer>
py::object call(const Outer& outer, const Layer& layer, Entry entry, py::handle x,
                py::handle source, const py::kwargs& kw) {
  using T = typename Layer::Scalar;
  const std::string name = std::string(Layer::kName) + "." +
                           (entry == Entry::Self     ? "forward"
                            : entry == Entry::Cached ? "forward_cached"
                                                     : "forward_cross");
  bool torch = false;
  const auto xa = input_array<T>(x, name + ": x", 3, &torch);
  const Index B = xa.shape(0), Tq = xa.shape(1);
  moh::ForwardOptions opts;
  std::vector<py::object> keep;  // every array the options view, alive until the call returns
  py::object routing_obj = py::none(), out_obj = py::none(), weights_obj = py::none();
  bool need_weights = false;
  py::object threads = py::int_(1);
  for (auto item : kw) {
    const std::string key = item.first.cast<std::string>();
    const py::handle v = item.second;
    const std::vector<std::string>& known = call_options();
    if (std::find(known.begin(), known.end(), key) == known.end()) {
      std::string list;
      for (const std::string& k : known) list += (list.empty() ? "" : ", ") + k;
      fail(name + ": unknown option '" + key + "': expected one of " + list);
    }
    if (key == "threads") {
      if (!v.is_none()) threads = py::reinterpret_borrow<py::object>(v);
      continue;
    }
    if (v.is_none()) continue;  // an option given as None is the option left out
    if (key == "key_padding_mask" || key == "new_token_padding_mask" ||
        key == "query_padding_mask") {
      auto m = mask_array(v, name + ": " + key);
      const moh::MaskMap map(m.data(), m.shape(0), m.shape(1));
      (key == "key_padding_mask"         ? opts.key_padding_mask
       : key == "new_token_padding_mask" ? opts.new_token_padding_mask
                                         : opts.query_padding_mask) = map;
      keep.push_back(std::move(m));
    } else if (key == "causal") {
      opts.causal = parse_causal(v, name);
    } else if (key == "mode") {
      opts.mode = parse_mode(v, name);
    } else if (key == "attn_bias") {
      auto b = input_array<T>(v, name + ": attn_bias", 4, nullptr, "[B or 1, H or 1, T, S]");
      opts.attn_bias = moh::Tensor4Ref<false>(b.data(), b.shape(0), b.shape(1), b.shape(2), b.shape(3));
      keep.push_back(std::move(b));
    } else if (key == "attention_weights") {
      weights_obj = py::reinterpret_borrow<py::object>(v);
    } else if (key == "need_weights") {
      need_weights = flag(v, name + ": need_weights");
    } else if (key == "grid") {
      if (!py::isinstance<py::sequence>(v) || py::len(v) != 2)
        fail(name + ": grid: expected (h, w), got " + std::string(py::repr(v)));
      const py::sequence g = py::reinterpret_borrow<py::sequence>(v);
      opts.grid_h = integer(g[0], name + ": grid");
      opts.grid_w = integer(g[1], name + ": grid");
    } else if (key == "position_offset") {
      opts.position_offset = integer(v, name + ": position_offset");
    } else if (key == "routing") {
      routing_obj = py::reinterpret_borrow<py::object>(v);
    } else if (key == "pool") {
      if (!py::isinstance<moh::ThreadPool>(v))
        fail(name + ": pool: expected a moh.ThreadPool, got " + type_name(v));
      opts.pool = &v.cast<moh::ThreadPool&>();
    } else {  // "out"
      out_obj = py::reinterpret_borrow<py::object>(v);
    }
  }
  moh::ThreadPool* pool = shared_pool(threads, name);
  if (pool && opts.pool) fail(name + ": threads and pool: expected one of them, got both");
  if (!opts.pool) opts.pool = pool;

  // The source of keys and values.
  py::array_t<T, py::array::c_style> mem;
  moh::KvCache<T>* cache = nullptr;
  // A cache and a routing record are this call's from here until it returns (taken and given
  // back with the GIL held): no other call or accessor reads them meanwhile.
  std::optional<InUse> cache_use, routing_use;
  Index keys = Tq;
  if (entry == Entry::Cross) {
    mem = input_array<T>(source, name + ": memory", 3);
    keys = mem.shape(1);
  } else if (entry == Entry::CrossCache || entry == Entry::Cached) {
    if (!py::isinstance<PyKvCache>(source))
      fail(name + ": cache: expected a moh.KvCache, got " + type_name(source));
    PyKvCache& c = source.cast<PyKvCache&>();
    cache_use.emplace(c.busy, name + ": cache");
    cache = &c.template as<T>(Layer::kName);
    keys = cache->length() + (entry == Entry::Cached ? Tq : 0);
  }

  // The probabilities: into the caller's array, or a new one returned with y.
  const std::vector<Index> weights_shape{B, probability_heads(layer), Tq, keys};
  py::array_t<T, py::array::c_style> weights;  // (a default array_t is an empty array, not null)
  const bool want_weights = need_weights || !weights_obj.is_none();
  if (!weights_obj.is_none()) {
    if (need_weights) fail(name + ": attention_weights and need_weights: expected one of them, got both");
    weights = output_array<T>(weights_obj, name + ": attention_weights", weights_shape);
  } else if (need_weights) {
    weights = py::array_t<T, py::array::c_style>(weights_shape);
  }
  if (want_weights)
    opts.attention_weights = moh::Tensor4Ref<true>(weights.mutable_data(), weights_shape[0],
                                                   weights_shape[1], weights_shape[2], weights_shape[3]);

  py::array_t<T, py::array::c_style> y =
      out_obj.is_none() ? py::array_t<T, py::array::c_style>({B, Tq, layer.embed_dim()})
                        : output_array<T>(out_obj, name + ": out", {B, Tq, layer.embed_dim()});

  typename Layer::RoutingRecord* routing = nullptr;
  if (!routing_obj.is_none()) {
    if constexpr (kIsMoH<Layer>) {
      if (!py::isinstance<PyMoHRouting>(routing_obj))
        fail(name + ": routing: expected a moh.MoHRouting, got " + type_name(routing_obj));
      PyMoHRouting& r = routing_obj.cast<PyMoHRouting&>();
      routing_use.emplace(r.busy, name + ": routing");
      routing = &r.template as<T>();
    } else if constexpr (kIsMoA<Layer>) {
      if (!py::isinstance<PyMoARouting>(routing_obj))
        fail(name + ": routing: expected a moh.MoARouting, got " + type_name(routing_obj));
      PyMoARouting& r = routing_obj.cast<PyMoARouting&>();
      routing_use.emplace(r.busy, name + ": routing");
      routing = &r.template as<T>();
    } else {
      fail(name + ": routing: MultiHeadAttention routes nothing: expected no routing record, got " +
           type_name(routing_obj));
    }
  }

  // What the call writes must not overlap what it reads (the layers: y may not alias x).
  struct Span {
    const char* what;
    const void* data;
    std::size_t bytes;
  };
  std::vector<Span> reads{{"x", xa.data(), static_cast<std::size_t>(xa.nbytes())}};
  if (entry == Entry::Cross) reads.push_back({"memory", mem.data(), static_cast<std::size_t>(mem.nbytes())});
  for (const py::object& k : keep) {
    const py::array a = py::reinterpret_borrow<py::array>(k);
    reads.push_back({"an option's array", a.data(), static_cast<std::size_t>(a.nbytes())});
  }
  auto overlap = [](const void* a, std::size_t na, const void* b, std::size_t nb) {
    const auto* pa = static_cast<const char*>(a);
    const auto* pb = static_cast<const char*>(b);
    return na > 0 && nb > 0 && pa < pb + nb && pb < pa + na;
  };
  std::vector<Span> writes;
  if (!out_obj.is_none()) writes.push_back({"out", y.data(), static_cast<std::size_t>(y.nbytes())});
  if (!weights_obj.is_none())
    writes.push_back({"attention_weights", weights.data(), static_cast<std::size_t>(weights.nbytes())});
  for (const Span& w : writes) {
    for (const Span& r : reads)
      if (overlap(w.data, w.bytes, r.data, r.bytes))
        fail(name + ": " + w.what + ": expected an array that shares no memory with what the call "
             "reads, got one that overlaps " + r.what);
    if (writes.size() == 2 && &w == &writes[0] && overlap(w.data, w.bytes, writes[1].data, writes[1].bytes))
      fail(name + ": out and attention_weights: expected arrays that share no memory, got two "
           "that overlap");
  }
  g_last_input = reinterpret_cast<std::uintptr_t>(xa.data());

  {
    typename Outer::Lease lease(outer);
    opts.workspace = lease.get();
    const py::gil_scoped_release unlocked;
    const std::shared_lock<std::shared_mutex> reading(outer.weights_mutex);
    moh::TensorMap3<T> ym(y.mutable_data(), B, Tq, layer.embed_dim());
    switch (entry) {
      case Entry::Self:
        layer.forward(map3(xa), ym, opts, routing);
        break;
      case Entry::Cross:
        layer.forward_cross(map3(xa), map3(mem), ym, opts, routing);
        break;
      case Entry::CrossCache:
        layer.forward_cross(map3(xa), *cache, ym, opts, routing);
        break;
      case Entry::Cached:
        layer.forward_cached(map3(xa), ym, *cache, opts, routing);
        break;
    }
  }
  py::object result = out_obj.is_none() ? py::object(y) : out_obj;
  if (torch && out_obj.is_none()) result = numpy_to_torch(result);
  if (need_weights) {
    py::object w = weights;
    if (torch) w = numpy_to_torch(w);
    return py::make_tuple(result, w);
  }
  return result;
}

/// Writes a {name: array} mapping as safetensors bytes (each array in its own float dtype).
std::vector<std::uint8_t> mapping_bytes(const py::dict& tensors, const std::string& layer) {
  moh::SafeTensorsWriter w;
  for (auto item : tensors) {
    const std::string key = item.first.cast<std::string>();
    py::object v = py::reinterpret_borrow<py::object>(item.second);
    if (is_torch_tensor(v)) v = torch_to_numpy(v, layer + ": load_state_dict: " + key);
    if (!py::isinstance<py::array>(v))
      fail(layer + ": load_state_dict: " + key + ": expected an array or a tensor, got " + type_name(v));
    const py::array a = v;
    std::vector<std::int64_t> shape(a.shape(), a.shape() + a.ndim());
    if (py::isinstance<py::array_t<double>>(a)) {
      const auto c = py::array_t<double, py::array::c_style>::ensure(a);
      w.add(key, c.data(), shape, moh::DType::F64);
    } else if (py::isinstance<py::array_t<float>>(a)) {
      const auto c = py::array_t<float, py::array::c_style>::ensure(a);
      w.add(key, c.data(), shape, moh::DType::F32);
    } else {
      fail(layer + ": load_state_dict: " + key + ": expected float32 or float64 values, got " +
           std::string(py::str(a.dtype())));
    }
  }
  return w.to_bytes();
}

/// A safetensors file, or a sharded checkpoint by its .index.json.
class Source {
 public:
  explicit Source(const std::string& path) {
    const std::string index = ".index.json";
    if (path.size() > index.size() &&
        path.compare(path.size() - index.size(), index.size(), index) == 0)
      sharded_.emplace(moh::ShardedSafeTensors::open(path));
    else
      file_.emplace(moh::SafeTensors::open(path));
  }
  const moh::TensorSource& operator*() const {
    if (sharded_) return *sharded_;
    return *file_;
  }
  const moh::TensorSource* operator->() const { return &**this; }

 private:
  std::optional<moh::SafeTensors> file_;
  std::optional<moh::ShardedSafeTensors> sharded_;
};

moh::DType file_dtype(const std::string& s) {
  if (s == "float32") return moh::DType::F32;
  if (s == "float64") return moh::DType::F64;
  if (s == "float16") return moh::DType::F16;
  if (s == "bfloat16") return moh::DType::BF16;
  fail("save_safetensors: dtype: expected 'float32', 'float64', 'float16' or 'bfloat16', got '" + s + "'");
}

template <template <class> class L>
py::class_<PyLayer<L>, std::shared_ptr<PyLayer<L>>> bind_layer(py::module_& m, const char* name,
                                                              const char* doc) {
  using P = PyLayer<L>;
  using Config = typename P::Config;
  py::class_<P, std::shared_ptr<P>> cls(m, name, doc);
  cls.def(py::init<const Config&, const py::object&, bool, const std::string&>(), py::arg("config"),
          py::arg("seed") = py::none(), py::kw_only(), py::arg("zero_weights") = false,
          py::arg("dtype") = "float32",
          "A layer for `config`: with no weights (set them before forward), seeded random weights "
          "(seed=int, like torch.nn.Linear) or all zero (zero_weights=True); dtype 'float32' or "
          "'float64'.");
  cls.def_property_readonly("config", [](const P& p) { return p.visit([](const auto& l) { return l.config(); }); });
  cls.def_property_readonly("dtype", &P::dtype);
  cls.def_property_readonly("embed_dim", [](const P& p) { return p.visit([](const auto& l) { return l.embed_dim(); }); });
  cls.def_property_readonly("num_heads", [](const P& p) { return p.visit([](const auto& l) { return l.num_heads(); }); });
  cls.def_property("num_experts", [](const P& p) -> py::object {
    return p.visit([](const auto& l) -> py::object {
      if constexpr (std::is_same<typename std::decay_t<decltype(l)>::Config, moh::MoAConfig>::value)
        return py::int_(l.num_experts());
      else
        return py::none();
    });
  }, nullptr, "MoA's experts (E); None for the layers without experts.");
  cls.def_property_readonly("num_kv_heads", [](const P& p) { return p.visit([](const auto& l) { return l.num_kv_heads(); }); });
  cls.def_property_readonly("head_dim", [](const P& p) { return p.visit([](const auto& l) { return l.head_dim(); }); });
  cls.def_property_readonly("memory_dim", [](const P& p) { return p.visit([](const auto& l) { return l.memory_dim(); }); });
  cls.def_property_readonly("weights_set", [](const P& p) { return p.visit([](const auto& l) { return l.weights_set(); }); });
  cls.def_property_readonly("weight_bytes", [](const P& p) { return p.visit([](const auto& l) { return l.weight_bytes(); }); },
                            "Bytes of the projection weights as stored (halved by bfloat16 storage).");

  cls.def(
      "forward",
      [](const P& p, py::handle x, const py::kwargs& kw) {
        return p.visit([&](const auto& l) { return call(p, l, Entry::Self, x, py::none(), kw); });
      },
      py::arg("x"),
      "Self-attention on x [B, T, D] -> y [B, T, D] (y, probabilities with need_weights=True).");
  cls.def(
      "__call__",
      [](const P& p, py::handle x, const py::kwargs& kw) {
        return p.visit([&](const auto& l) { return call(p, l, Entry::Self, x, py::none(), kw); });
      },
      py::arg("x"));
  cls.def(
      "forward_cross",
      [](const P& p, py::handle x, py::handle memory, const py::kwargs& kw) {
        const Entry e = py::isinstance<PyKvCache>(memory) ? Entry::CrossCache : Entry::Cross;
        return p.visit([&](const auto& l) { return call(p, l, e, x, memory, kw); });
      },
      py::arg("x"), py::arg("memory"),
      "Cross-attention: queries from x [B, T, D], keys and values from memory [B, S, memory_dim] "
      "or from a memory cache (make_memory_cache).");
  cls.def(
      "forward_cached",
      [](const P& p, py::handle x, py::handle cache, const py::kwargs& kw) {
        return p.visit([&](const auto& l) { return call(p, l, Entry::Cached, x, cache, kw); });
      },
      py::arg("x"), py::arg("cache"),
      "Incremental self-attention: x [B, T_new, D] continues each sequence of `cache` (causal by "
      "default); the new keys and values are appended.");
  cls.def(
      "make_cache",
      [](const P& p, py::handle batch, py::handle capacity, py::handle storage) {
        return p.visit([&](const auto& l) {
          const std::string what = std::string(std::decay_t<decltype(l)>::kName) + ".make_cache";
          return PyKvCache{l.make_cache(integer(batch, what + ": batch"),
                                        integer(capacity, what + ": capacity"),
                                        cache_storage(storage, what))};
        });
      },
      py::arg("batch"), py::arg("capacity"), py::arg("storage") = moh::CacheStorage::Native,
      "A cache for `batch` sequences of up to `capacity` tokens; storage moh.CacheStorage.Native "
      "(the layer's dtype) or .BFloat16 (also 'native', 'bfloat16').");
  cls.def(
      "make_memory_cache",
      [](const P& p, py::handle memory, py::object key_padding_mask, py::handle threads) {
        return p.visit([&](const auto& l) {
          using T = typename std::decay_t<decltype(l)>::Scalar;
          const std::string what = std::string(std::decay_t<decltype(l)>::kName) + ".make_memory_cache";
          const auto mem = input_array<T>(memory, what + ": memory", 3);
          moh::ForwardOptions opts;
          py::array_t<bool, py::array::c_style> mask;
          if (!key_padding_mask.is_none()) {
            mask = mask_array(key_padding_mask, what + ": key_padding_mask");
            opts.key_padding_mask = moh::MaskMap(mask.data(), mask.shape(0), mask.shape(1));
          }
          opts.pool = shared_pool(threads, what);
          typename P::Lease lease(p);
          opts.workspace = lease.get();
          const py::gil_scoped_release unlocked;
          const std::shared_lock<std::shared_mutex> reading(p.weights_mutex);
          return PyKvCache{l.make_memory_cache(map3(mem), opts)};
        });
      },
      py::arg("memory"), py::arg("key_padding_mask") = py::none(), py::arg("threads") = 1,
      "The keys and values of memory [B, S, memory_dim] computed once, for forward_cross.");

  cls.def(
      "weight_infos",
      [](const P& p) {
        return p.visit([](const auto& l) {
          py::list out;
          for (const moh::WeightInfo& w : l.weight_infos()) out.append(py::make_tuple(w.name, py::tuple(py::cast(w.shape))));
          return out;
        });
      },
      "[(name, shape)] of the layer's tensors under the authors' PyTorch names.");
  cls.def(
      "weight_layouts",
      [](const P& p) {
        return p.visit([](const auto& l) {
          py::list out;
          for (const moh::WeightInfo& w : l.weight_infos()) {
            py::list parts;
            for (const moh::WeightInfo& part : w.parts)
              parts.append(py::make_tuple(part.name, py::tuple(py::cast(part.shape))));
            out.append(py::make_tuple(w.name, py::tuple(py::cast(w.shape)), parts,
                                      py::cast(w.aliases)));
          }
          return out;
        });
      },
      "[(name, shape, parts, aliases)]: the other layouts each tensor is published in (parts: "
      "[(name, shape)] stacked along the first axis, e.g. LLaMA's q_proj, k_proj, v_proj; "
      "aliases: the same tensor under other names, e.g. o_proj.weight).");
  cls.def(
      "weight",
      [](const P& p, const std::string& wname) {
        return p.visit([&](const auto& l) {
          using T = typename std::decay_t<decltype(l)>::Scalar;
          std::vector<T> v;
          {
            const py::gil_scoped_release unlocked;
            const std::shared_lock<std::shared_mutex> reading(p.weights_mutex);
            v = l.weight(wname);
          }
          std::vector<std::int64_t> shape;
          for (const moh::WeightInfo& w : l.weight_infos())
            if (w.name == wname) shape = w.shape;
          py::array_t<T> a(shape);
          std::copy(v.begin(), v.end(), a.mutable_data());
          return py::object(std::move(a));
        });
      },
      py::arg("name"), "A copy of tensor `name` in its PyTorch shape.");
  cls.def(
      "set_weight",
      [](P& p, const std::string& wname, py::handle value) {
        p.visit_mut([&](auto& l) {
          using T = typename std::decay_t<decltype(l)>::Scalar;
          const std::string what = std::string(std::decay_t<decltype(l)>::kName) + ": " + wname;
          py::object v = py::reinterpret_borrow<py::object>(value);
          if (is_torch_tensor(v)) v = torch_to_numpy(v, what);
          const moh::WeightInfo* info = nullptr;
          for (const moh::WeightInfo& w : l.weight_infos())
            if (w.name == wname) info = &w;
          if (!info) {
            l.weight(wname);  // throws the layer's own error, naming its tensors
          }
          if (!py::isinstance<py::array>(v)) fail(what + ": expected an array or a tensor, got " + type_name(v));
          const py::array a = v;
          if (!(py::isinstance<py::array_t<float>>(a) || py::isinstance<py::array_t<double>>(a)))
            fail(what + ": expected float32 or float64 values, got " + std::string(py::str(a.dtype())));
          bool same = a.ndim() == static_cast<py::ssize_t>(info->shape.size());
          for (std::size_t i = 0; same && i < info->shape.size(); ++i) same = a.shape(i) == info->shape[i];
          if (!same) {
            std::string want = "[";
            for (std::size_t i = 0; i < info->shape.size(); ++i) want += (i ? ", " : "") + std::to_string(info->shape[i]);
            fail(what + ": expected shape " + want + "], got " + shape_of(a));
          }
          const auto c = py::array_t<T, py::array::c_style | py::array::forcecast>::ensure(a);
          const py::gil_scoped_release unlocked;
          const std::unique_lock<std::shared_mutex> writing(p.weights_mutex);
          l.set_weight(wname, c.data(), static_cast<Index>(c.size()));
        });
      },
      py::arg("name"), py::arg("value"),
      "Sets tensor `name` from an array or tensor of exactly its PyTorch shape (float32 or "
      "float64, converted to the layer's dtype).");
  cls.def(
      "load_state_dict",
      [](P& p, const py::dict& tensors, const std::string& prefix) {
        p.visit_mut([&](auto& l) {
          const std::string layer = std::decay_t<decltype(l)>::kName;
          const moh::SafeTensors st = moh::SafeTensors::from_bytes(mapping_bytes(tensors, layer), "state_dict");
          const py::gil_scoped_release unlocked;
          const std::unique_lock<std::shared_mutex> writing(p.weights_mutex);
          moh::load_weights(l, st, prefix);
        });
      },
      py::arg("state_dict"), py::arg("prefix") = "",
      "Loads every tensor from {name: array or tensor} under the authors' or Hugging Face names "
      "(with `prefix`), as load_weights does: shapes checked, fused or split layouts, tensors of "
      "modules moh does not implement refused.");
  cls.def(
      "load_safetensors",
      [](P& p, py::handle path, const std::string& prefix) {
        const Source src(path_of(path, "load_safetensors"));
        const py::gil_scoped_release unlocked;
        const std::unique_lock<std::shared_mutex> writing(p.weights_mutex);
        p.visit_mut([&](auto& l) { moh::load_weights(l, *src, prefix); });
      },
      py::arg("path"), py::arg("prefix") = "",
      "Loads the weights from a .safetensors file or a sharded checkpoint's .index.json.");
  cls.def(
      "save_safetensors",
      [](const P& p, py::handle path, const std::string& prefix, const std::string& dtype) {
        const std::string file = path_of(path, "save_safetensors");
        const moh::DType type = file_dtype(dtype);
        p.visit([&](const auto& l) {
          const py::gil_scoped_release unlocked;
          moh::SafeTensorsWriter w;
          {
            const std::shared_lock<std::shared_mutex> reading(p.weights_mutex);
            moh::save_weights(w, l, prefix, type);
          }
          w.write(file);
        });
      },
      py::arg("path"), py::arg("prefix") = "", py::arg("dtype") = "float32",
      "Writes the weights (the authors' fused names) and the config, which moh.load_safetensors "
      "rebuilds the layer from.");
  cls.def("__repr__", [name](const P& p) {
    return std::string(name) + "(" +
           std::string(py::repr(py::cast(p.visit([](const auto& l) { return l.config(); })))) +
           ", dtype='" + p.dtype() + "')";
  });
  return cls;
}

template <class T>
py::object moh_position_bias(const moh::MoHAttention<T>& l, Index h, Index w) {
  const std::vector<T> v = l.position_bias(h, w);
  py::array_t<T> a({l.num_heads(), h * w, h * w});
  std::copy(v.begin(), v.end(), a.mutable_data());
  return std::move(a);
}

py::object load_layer_file(py::handle path_arg, const std::string& prefix, const std::string& dtype) {
  const std::string path = path_of(path_arg, "load_safetensors");
  const Source src(path);
  const std::string key = moh::config_key(prefix);
  if (!src->has_metadata(key))
    fail("load_safetensors: " + path + ": expected a layer saved by moh (metadata '" + key +
         "'), got a file without it: build the layer from its config and call "
         "layer.load_safetensors(path) instead");
  const std::string text = src->metadata_value(key);
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  const std::string kind = j.is_object() && j.contains("layer") && j["layer"].is_string()
                               ? j["layer"].get<std::string>()
                               : std::string();
  if (dtype != "float32" && dtype != "float64")
    fail("load_safetensors: dtype: expected 'float32' or 'float64', got '" + dtype + "'");
  const bool f32 = dtype == "float32";
  auto make = [&](auto tag) -> py::object {
    using P = typename decltype(tag)::type;
    if (f32) return py::cast(std::make_shared<P>(moh::load_layer<typename P::F32>(*src, prefix)));
    return py::cast(std::make_shared<P>(moh::load_layer<typename P::F64>(*src, prefix)));
  };
  if (kind == moh::MHAConfig::kLayer) return make(std::common_type<PyLayer<moh::MultiHeadAttention>>{});
  if (kind == moh::MoHConfig::kLayer) return make(std::common_type<PyLayer<moh::MoHAttention>>{});
  if (kind == moh::MoAConfig::kLayer) return make(std::common_type<PyLayer<moh::MoAAttention>>{});
  fail("load_safetensors: " + path + ": metadata '" + key + "': 'layer': expected " +
       "MultiHeadAttention, MoHAttention or MoAAttention, got '" + kind + "'");
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "moh's C++ layers (MHA, MoH, MoA) on NumPy arrays and CPU torch tensors.";

  static py::exception<moh::Error> error(m, "Error", PyExc_ValueError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const moh::Error& e) {
      PyErr_SetString(error.ptr(), e.what());
    }
  });

  // Enums: the C++ names; a config field also takes the name moh saves it under ("query_norm").
  py::enum_<moh::WeightStorage>(m, "WeightStorage")
      .value("Native", moh::WeightStorage::Native)
      .value("BFloat16", moh::WeightStorage::BFloat16)
      .value("NativePacked", moh::WeightStorage::NativePacked);
  py::enum_<moh::CacheStorage>(m, "CacheStorage")
      .value("Native", moh::CacheStorage::Native)
      .value("BFloat16", moh::CacheStorage::BFloat16);
  py::enum_<moh::MoHRouterKind>(m, "MoHRouterKind")
      .value("Learned", moh::MoHRouterKind::Learned)
      .value("QueryNorm", moh::MoHRouterKind::QueryNorm);
  py::enum_<moh::MoHScores>(m, "MoHScores")
      .value("Dot", moh::MoHScores::Dot)
      .value("Cosine", moh::MoHScores::Cosine);
  py::enum_<moh::MoAGating>(m, "MoAGating")
      .value("Softmax", moh::MoAGating::Softmax)
      .value("TopKSoftmax", moh::MoAGating::TopKSoftmax);
  py::enum_<moh::MoANames>(m, "MoANames")
      .value("Fairseq", moh::MoANames::Fairseq)
      .value("JetMoE", moh::MoANames::JetMoE);
  py::enum_<moh::Causal>(m, "Causal")
      .value("Auto", moh::Causal::Auto)
      .value("On", moh::Causal::On)
      .value("Off", moh::Causal::Off);
  py::enum_<moh::ComputeMode>(m, "ComputeMode")
      .value("Auto", moh::ComputeMode::Auto)
      .value("Sparse", moh::ComputeMode::Sparse)
      .value("Dense", moh::ComputeMode::Dense);

  bind_config<moh::MHAConfig>(m, "MHAConfig", "Sizes and settings of a MultiHeadAttention layer.");
  bind_config<moh::MoHConfig>(m, "MoHConfig", "Sizes and settings of a MoHAttention layer.")
      .def_static("vit", &moh::MoHConfig::vit, py::arg("embed_dim"), py::arg("num_heads"),
                  py::arg("shared_heads"), py::arg("active_routed_heads"), py::arg("grid_h"),
                  py::arg("grid_w"), "MoH-ViT's last-stage cosine attention for a grid_h x grid_w grid.")
      .def_static("moh_llama3", &moh::MoHConfig::moh_llama3, py::arg("embed_dim"),
                  py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("rope_theta") = 500000.0,
                  "MoH-LLaMA3's attention: query-norm router, RoPE, no bias, num_heads / 2 "
                  "shared heads and the top num_heads / 4 of the other half per token.")
      .def_static("moh_llama3_8b", &moh::MoHConfig::moh_llama3_8b,
                  "MoH-LLaMA3-8B's attention as released: D 4096, 32 heads of 128 over 8 kv "
                  "heads, RoPE base 500000, heads 0-15 shared, the top 8 of heads 16-31 routed.")
      .def("routed_heads", &moh::MoHConfig::routed_heads)
      .def("active_fraction", &moh::MoHConfig::active_fraction);
  bind_config<moh::MoAConfig>(m, "MoAConfig", "Sizes and settings of a MoAAttention layer.")
      .def_static("jetmoe", &moh::MoAConfig::jetmoe, py::arg("embed_dim"), py::arg("num_kv_heads"),
                  py::arg("num_experts"), py::arg("top_k"), py::arg("head_dim"),
                  py::arg("rope_theta") = 10000.0, "JetMoE's attention: multi-head experts, RoPE, top-k-then-softmax gates, an output bias.")
      .def("kv_heads", &moh::MoAConfig::kv_heads)
      .def("memory_dim", &moh::MoAConfig::memory_dim);

  py::class_<moh::ThreadPool>(m, "ThreadPool", "A pool of threads (the caller counts as one).")
      .def(py::init<int>(), py::arg("num_threads"))
      .def_property_readonly("size", &moh::ThreadPool::size);

  py::class_<PyKvCache>(m, "KvCache", "Keys and values of a batch of sequences (make_cache, make_memory_cache).")
      .def_property_readonly("batch", [](PyKvCache& c) { return c.visit([](auto& k) { return k.batch(); }); })
      .def_property_readonly("kv_heads", [](PyKvCache& c) { return c.visit([](auto& k) { return k.kv_heads(); }); })
      .def_property_readonly("head_dim", [](PyKvCache& c) { return c.visit([](auto& k) { return k.head_dim(); }); })
      .def_property_readonly("capacity", [](PyKvCache& c) { return c.visit([](auto& k) { return k.capacity(); }); })
      .def_property_readonly("storage", [](PyKvCache& c) { return c.visit([](auto& k) { return k.storage(); }); })
      .def_property_readonly("bytes", [](PyKvCache& c) { return c.visit([](auto& k) { return k.bytes(); }); })
      .def_property_readonly("is_memory", [](PyKvCache& c) { return c.visit([](auto& k) { return k.is_memory(); }); })
      .def_property_readonly("ragged", [](PyKvCache& c) { return c.visit([](auto& k) { return k.ragged(); }); })
      .def_property_readonly("dtype", [](PyKvCache& c) {
        return std::holds_alternative<moh::KvCache<float>>(c.cache) ? "float32" : "float64";
      })
      .def("length", [](PyKvCache& c, py::object b) {
             return c.visit([&](auto& k) { return b.is_none() ? k.length() : k.length(integer(b, "KvCache.length: b")); });
           }, py::arg("b") = py::none(), "Tokens held by sequence b, or the longest sequence's.")
      .def("lengths", [](PyKvCache& c) {
        return c.visit([](auto& k) {
          std::vector<Index> out;
          for (Index b = 0; b < k.batch(); ++b) out.push_back(k.length(b));
          return out;
        });
      })
      .def("reset", [](PyKvCache& c, py::object b) {
             c.visit([&](auto& k) { b.is_none() ? k.reset() : k.reset(integer(b, "KvCache.reset: b")); });
           }, py::arg("b") = py::none(), "Empties sequence b, or every sequence.")
      .def("truncate", [](PyKvCache& c, py::handle a, py::object n) {
             c.visit([&](auto& k) {
               const Index first = integer(a, "KvCache.truncate");
               n.is_none() ? k.truncate(first) : k.truncate(first, integer(n, "KvCache.truncate: length"));
             });
           }, py::arg("length_or_b"), py::arg("length") = py::none(),
           "truncate(n): every sequence cut back to at most n tokens; truncate(b, n): sequence b only.")
      .def("clone", [](PyKvCache& c) { return c.visit([](auto& k) { return PyKvCache{k.clone()}; }); });

  py::class_<PyMoHRouting>(m, "MoHRouting", "Which heads each token of a MoH call used (filled by forward).")
      .def(py::init<>())
      .def_property_readonly("batch", [](PyMoHRouting& r) { return std::visit([](auto& x) { return x.batch; }, r.read("routing record")); })
      .def_property_readonly("tokens", [](PyMoHRouting& r) { return std::visit([](auto& x) { return x.tokens; }, r.read("routing record")); })
      .def_property_readonly("num_heads", [](PyMoHRouting& r) { return std::visit([](auto& x) { return x.num_heads; }, r.read("routing record")); })
      .def_property_readonly("shared_heads", [](PyMoHRouting& r) { return std::visit([](auto& x) { return x.shared_heads; }, r.read("routing record")); })
      .def_property_readonly("active_routed_heads", [](PyMoHRouting& r) { return std::visit([](auto& x) { return x.active_routed_heads; }, r.read("routing record")); })
      .def_property_readonly("gates", [](PyMoHRouting& r) { return std::visit([](auto& x) { return matrix_array(x.gates); }, r.read("routing record")); },
                             "[B*T, H]: each head's output weight, exactly 0 for unused heads.")
      .def_property_readonly("active", [](PyMoHRouting& r) { return std::visit([](auto& x) { return matrix_array(x.active); }, r.read("routing record")); },
                             "[B*T, H] bool: the heads each token used.")
      .def_property_readonly("routed_probs", [](PyMoHRouting& r) { return std::visit([](auto& x) { return matrix_array(x.routed_probs); }, r.read("routing record")); },
                             "[B*T, H - shared_heads]: router probabilities before top-K.")
      .def_property_readonly("head_counts", [](PyMoHRouting& r) { return std::visit([](auto& x) { return vector_array(x.head_counts); }, r.read("routing record")); },
                             "[H]: tokens that used each head.")
      .def_property_readonly("load_balance_loss", [](PyMoHRouting& r) { return std::visit([](auto& x) { return static_cast<double>(x.load_balance_loss); }, r.read("routing record")); })
      .def("active_fraction", [](PyMoHRouting& r) { return std::visit([](auto& x) { return x.active_fraction(); }, r.read("routing record")); })
      .def("heads_of", [](PyMoHRouting& r, Index b, Index t) {
        return std::visit([&](auto& x) {
          if (b < 0 || b >= x.batch || t < 0 || t >= x.tokens)
            fail("MoHRouting.heads_of: expected b in [0, " + std::to_string(x.batch) + ") and t in [0, " +
                 std::to_string(x.tokens) + "), got (" + std::to_string(b) + ", " + std::to_string(t) + ")");
          return x.heads_of(b, t);
        }, r.read("routing record"));
      }, py::arg("b"), py::arg("t"));

  py::class_<PyMoARouting>(m, "MoARouting", "Which experts each token of a MoA call used (filled by forward).")
      .def(py::init<>())
      .def_property_readonly("batch", [](PyMoARouting& r) { return std::visit([](auto& x) { return x.batch; }, r.read("routing record")); })
      .def_property_readonly("tokens", [](PyMoARouting& r) { return std::visit([](auto& x) { return x.tokens; }, r.read("routing record")); })
      .def_property_readonly("num_experts", [](PyMoARouting& r) { return std::visit([](auto& x) { return x.num_experts; }, r.read("routing record")); })
      .def_property_readonly("top_k", [](PyMoARouting& r) { return std::visit([](auto& x) { return x.top_k; }, r.read("routing record")); })
      .def_property_readonly("logits", [](PyMoARouting& r) { return std::visit([](auto& x) { return matrix_array(x.logits); }, r.read("routing record")); })
      .def_property_readonly("probs", [](PyMoARouting& r) { return std::visit([](auto& x) { return matrix_array(x.probs); }, r.read("routing record")); })
      .def_property_readonly("gates", [](PyMoARouting& r) { return std::visit([](auto& x) { return matrix_array(x.gates); }, r.read("routing record")); },
                             "[B*T, E]: gates of the kept experts, exactly 0 elsewhere.")
      .def_property_readonly("selected", [](PyMoARouting& r) { return std::visit([](auto& x) { return matrix_array(x.selected); }, r.read("routing record")); },
                             "[B*T, k]: each slot's expert, -1 for a query padding token.")
      .def_property_readonly("expert_counts", [](PyMoARouting& r) { return std::visit([](auto& x) { return vector_array(x.expert_counts); }, r.read("routing record")); })
      .def_property_readonly("switch_loss", [](PyMoARouting& r) { return std::visit([](auto& x) { return static_cast<double>(x.switch_loss); }, r.read("routing record")); })
      .def_property_readonly("z_loss", [](PyMoARouting& r) { return std::visit([](auto& x) { return static_cast<double>(x.z_loss); }, r.read("routing record")); })
      .def_property_readonly("cv_loss", [](PyMoARouting& r) { return std::visit([](auto& x) { return static_cast<double>(x.cv_loss); }, r.read("routing record")); })
      .def("active_fraction", [](PyMoARouting& r) { return std::visit([](auto& x) { return x.active_fraction(); }, r.read("routing record")); });

  bind_layer<moh::MultiHeadAttention>(m, "MultiHeadAttention",
                                      "Dense multi-head attention, as torch.nn.MultiheadAttention (GQA, RoPE).");
  bind_layer<moh::MoHAttention>(m, "MoHAttention",
                                "Mixture-of-Head attention: shared and routed heads, weighted sum; "
                                "MoH-ViT's cosine attention with MoHConfig.vit.")
      .def("position_bias", [](const PyLayer<moh::MoHAttention>& p, Index h, Index w) {
        return p.visit([&](const auto& l) { return moh_position_bias(l, h, w); });
      }, py::arg("grid_h"), py::arg("grid_w"), "Cosine attention's position bias [H, T, T] for a grid.");
  bind_layer<moh::MoAAttention>(m, "MoAAttention",
                                "Mixture of attention heads: fairseq MoA (num_kv_heads 1) and "
                                "JetMoE's multi-head experts (MoAConfig.jetmoe).");

  m.def("load_safetensors", &load_layer_file, py::arg("path"), py::arg("prefix") = "",
        py::arg("dtype") = "float32",
        "The layer save_safetensors wrote: its kind and config from the file's metadata.");
  m.def("_after_fork_in_child", &after_fork_in_child,
        "Forgets the thread pools of threads= calls in a child made by fork (their threads do not "
        "exist there); the package registers it with os.register_at_fork.");
  m.def("_last_input_pointer", [] { return g_last_input.load(); },
        "The address of the x the last call read (the zero-copy test compares it with the input's).");
  m.def("input_copies", [] { return g_input_copies.load(); },
        "How many inputs were copied so far because they were not C-contiguous arrays of the "
        "layer's dtype (the zero-copy check of the tests).");
}
