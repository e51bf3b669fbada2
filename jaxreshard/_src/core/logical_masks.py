"""Mask and label functions of a wrapped optimizer see the params' logical shapes.

``flat_sharded`` runs an optax optimizer on flat, padded params. Optax calls a
mask or label *function* (``optax.masked``'s ``mask``, ``multi_transform``'s
``param_labels``, and through them ``adamw``/``lamb``/``lars``'s masks and
``add_decayed_weights``') on the tree it is given, so on the flat params it
would see 1-D arrays: "decay only matrices" would decay nothing. Here every
such function reachable from the optimizer is wrapped so that, while
:func:`logical_shapes` is active, it is called with ``jax.ShapeDtypeStruct``
stand-ins of the params' own shapes (optax requires masks to be static, i.e.
functions of the tree, shapes and dtypes only), and the pytree it returns is
used as the unwrapped optimizer would use it.

``optax.tree_map_params`` (which finds the subtrees of a state that mirror the
params, for every path that lays a state out flat) runs the optimizer's ``init``
on a placeholder that stands for the whole params tree. ``optax.masked`` passes
it down without calling its mask; ``multi_transform`` calls its label function
on it, and a function that walks the params' structure (flax's
``traverse_util.path_aware_map``, a loop over the dict's keys) fails there. A
wrapped function called with the placeholder gives back labels of its structure
without being called, as ``optax.masked`` does: only the state's structure is
read, never which label a param has.

The functions live in the closures of optax's combinators; they are found by
walking closures (functions, bound methods of optimizer objects such as
``optax.MultiSteps``, partials, tuples, lists, dicts) and recognised by the
code of the optax functions that call them. Functions whose closures hold one
are copied with the wrapped function in its place; the user's optimizer is
never modified. A function optax builds while it runs
(``inject_hyperparams(..., static_args=("mask",))``) is wrapped where
``inject_hyperparams`` keeps it.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
import functools
import importlib
import types
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import optax

from jaxreshard._src.core.ids import path_id
from jaxreshard._src.errors import PlacementError, ShapeError

__all__ = ["LogicalCallable", "logical_shapes", "with_logical_callables"]


@dataclasses.dataclass(frozen=True)
class _Logical:
  """param id -> (logical shape, dtype) of the params of the running call."""

  params: Mapping[str, tuple[tuple[int, ...], Any]]


_ACTIVE: contextvars.ContextVar[_Logical | None] = contextvars.ContextVar(
  "jaxreshard_logical_shapes", default=None
)


@contextlib.contextmanager
def logical_shapes(params: Mapping[str, tuple[tuple[int, ...], Any]]) -> Iterator[None]:
  """Inside the block, wrapped functions see params of these ``(shape, dtype)``s."""
  token = _ACTIVE.set(_Logical(dict(params)))
  try:
    yield
  finally:
    _ACTIVE.reset(token)


def _placeholder_type() -> type | None:
  """The class of the placeholder ``optax.tree_map_params`` runs ``init`` on, or None
  where this optax keeps it elsewhere."""
  try:
    module = importlib.import_module("optax.tree_utils._state_utils")
  except ImportError:
    return None
  found = getattr(module, "_ParamsPlaceholder", None)
  return found if isinstance(found, type) else None


_PLACEHOLDER = _placeholder_type()


def placeholder_refusal(ids: list[str], error: Exception) -> ShapeError | None:
  """The refusal of a state whose roles ``optax.tree_map_params`` could not find
  because a function of the user's that ``init`` calls with the params (MultiSteps'
  ``should_skip_update_fn``) failed on its placeholder; None for another ``error``."""
  if "_ParamsPlaceholder" not in str(error):
    return None
  return ShapeError(
    f"params {ids[:3]}{'...' if len(ids) > 3 else ''}: the subtrees of the state that"
    " mirror the params are found by optax.tree_map_params, which runs the optimizer's"
    " init on a placeholder standing for the whole params tree, and a function the"
    " optimizer calls there with the params (a MultiSteps should_skip_update_fn) failed"
    f" on it ({type(error).__name__}: {str(error).splitlines()[0]}): write it as a"
    " function of the whole tree (jax.tree.map), not of the params' keys"
  )


def _is_masked_node(x: Any) -> bool:
  return isinstance(x, optax.MaskedNode)


class LogicalCallable:
  """A mask or label function that sees the params' logical shapes (see the module)."""

  def __init__(self, fn: Any, what: str, *, params_only: bool = True):
    # params_only: the function is always called on a params tree (a mask or
    # labels), so a tree of other leaves is a part of the params, refused.
    self.fn, self.what, self.params_only = fn, what, params_only

  def __repr__(self) -> str:
    return f"LogicalCallable({self.fn!r})"

  def __call__(self, tree: Any, *args: Any, **kwargs: Any) -> Any:
    if _PLACEHOLDER is not None and isinstance(tree, _PLACEHOLDER):
      return jax.tree.map(lambda _: None, tree)
    logical = _ACTIVE.get()
    if logical is None:
      return self.fn(tree, *args, **kwargs)
    with_path, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_masked_node)
    known = [path_id(p) in logical.params for p, x in with_path if not _is_masked_node(x)]
    if not known or (not any(known) and not self.params_only):
      # No leaves, or not a params tree (a static argument for something else).
      return self.fn(tree, *args, **kwargs)
    if not all(known):
      path = next(
        jax.tree_util.keystr(p)
        for (p, x), k in zip((e for e in with_path if not _is_masked_node(e[1])), known)
        if not k
      )
      raise PlacementError(
        f"flat_sharded: {self.what} {self._name()} is called on a tree whose leaf {path} is"
        " not a parameter; only functions of the whole params tree can be given the"
        " params' shapes: pass the mask or labels as a pytree"
      )
    leaves = []
    for p, x in with_path:
      if _is_masked_node(x):
        leaves.append(x)
        continue
      shape, dtype = logical.params[path_id(p)]
      leaves.append(jax.ShapeDtypeStruct(shape, getattr(x, "dtype", dtype)))
    return self.fn(jax.tree_util.tree_unflatten(treedef, leaves), *args, **kwargs)

  def _name(self) -> str:
    return repr(getattr(self.fn, "__qualname__", self.fn))


@functools.cache
def _sites() -> dict[Any, dict[str, str]]:
  """Code of the optax functions that call mask/label functions -> {free variable: what}."""

  def probe(p):
    return p

  masked = optax.masked(optax.identity(), probe)
  partition = optax.multi_transform({"a": optax.identity()}, probe)
  inject = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
  out: dict[Any, dict[str, str]] = {}
  for fn in (masked.init, masked.update):
    out[fn.__code__] = {"mask": "the mask function"}
  for fn in (partition.init, partition.update):
    out[fn.__code__] = {"param_labels": "the label function"}
  for fn in (inject.init, inject.update):
    out[fn.__code__] = {"other_hps": "the static hyper-parameter"}
  return out


@functools.cache
def _shape_sites() -> dict[Any, str]:
  """Code of the optax transformations that read a param's shape or average over its
  elements -> their names: on flat zero-padded shards they would give other updates
  (a mean's count includes the padding; a row or a column is not one any more)."""
  args = {
    "clip_by_block_rms": (1.0,),
    "scale_by_param_block_rms": (),
    "scale_by_param_block_norm": (),
    "centralize": (),
    "adaptive_grad_clip": (1.0,),
    "contrib.scale_by_muon": (),  # orthogonalizes each matrix (muon)
  }
  made = {}
  for name, a in args.items():
    where: Any = optax
    for part in name.split("."):
      where = getattr(where, part, None)  # an optax without it cannot hold it
    if where is not None:
      made[name] = where(*a)
  # Sophia's Hessian estimate (its default one) calls the loss on the params it is
  # given: on flat shards the loss would see 1-D padded arrays, not the model's.
  sophia = getattr(getattr(optax, "contrib", None), "_sophia", None)
  estimate = getattr(sophia, "hutchinson_estimator_diag_hessian", None)
  if estimate is not None:
    made["contrib.sophia"] = estimate()
  return {t.update.__code__: f"optax.{name}" for name, t in made.items()}


def shape_dependent_refusal(optimizer: Any) -> ShapeError | None:
  """The refusal of an ``optimizer`` holding (at any depth of chains, closures and
  optimizer objects) a transformation that reads a param's shape or averages over
  its elements, or None."""
  walker = _Rewriter()
  walker(optimizer)
  if not walker.shape_dependent:
    return None
  return ShapeError(
    f"{', '.join(sorted(set(walker.shape_dependent)))} reads each param's shape,"
    " averages over its elements or evaluates the loss on the params: on flat"
    " zero-padded shards it would give other updates, so flat_sharded refuses it"
  )


def with_logical_callables(optimizer: Any) -> Any:
  """``optimizer`` with every mask and label function wrapped (the same object if none)."""
  return _Rewriter()(optimizer)


def _is_namedtuple(x: Any) -> bool:
  return isinstance(x, tuple) and hasattr(type(x), "_fields")


class _Rewriter:
  """Copies of closures, methods and containers with mask/label functions wrapped."""

  def __init__(self):
    self.memo: dict[int, Any] = {}
    self.keep: list[Any] = []  # keeps memo ids valid while walking
    self.shape_dependent: list[str] = []  # ``_shape_sites`` met on the way

  def __call__(self, obj: Any) -> Any:
    key = id(obj)
    if key in self.memo:
      return self.memo[key]
    self.memo[key] = obj  # a cycle sees the original
    self.keep.append(obj)
    out = self._rewrite(obj)
    self.memo[key] = out
    return out

  def _rewrite(self, obj: Any) -> Any:
    if isinstance(obj, types.FunctionType):
      return self._function(obj)
    if isinstance(obj, types.MethodType):
      func, owner = self(obj.__func__), self._object(obj.__self__)
      return (
        obj if func is obj.__func__ and owner is obj.__self__ else types.MethodType(func, owner)
      )
    if isinstance(obj, functools.partial):
      func, args = self(obj.func), [self(a) for a in obj.args]
      kwargs = {k: self(v) for k, v in obj.keywords.items()}
      if (
        func is obj.func
        and all(a is b for a, b in zip(args, obj.args))
        and all(kwargs[k] is obj.keywords[k] for k in kwargs)
      ):
        return obj
      return functools.partial(func, *args, **kwargs)
    if type(obj) in (tuple, list) or _is_namedtuple(obj):
      items = [self(x) for x in obj]
      if all(a is b for a, b in zip(items, obj)):
        return obj
      return type(obj)(*items) if _is_namedtuple(obj) else type(obj)(items)
    if type(obj) is dict:
      items = {k: self(v) for k, v in obj.items()}
      return obj if all(items[k] is obj[k] for k in obj) else items
    if callable(getattr(obj, "init", None)) and callable(getattr(obj, "update", None)):
      return self._object(obj)  # an optimizer object (optax.MultiSteps)
    return obj

  def _object(self, obj: Any) -> Any:
    attrs = getattr(obj, "__dict__", None)
    if not isinstance(attrs, dict) or isinstance(obj, type):
      return obj
    new = {k: self(v) for k, v in attrs.items()}
    changed = {k: v for k, v in new.items() if v is not attrs[k]}
    if not changed:
      return obj
    out = copy.copy(obj)
    out.__dict__.update(changed)
    return out

  def _function(self, fn: types.FunctionType) -> types.FunctionType:
    name = _shape_sites().get(fn.__code__)
    if name is not None:
      self.shape_dependent.append(name)
    if not fn.__closure__:
      return fn
    site = _sites().get(fn.__code__, {})
    cells, changed = [], False
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__):
      try:
        value = cell.cell_contents
      except ValueError:  # an empty cell
        cells.append(cell)
        continue
      if name in site and name == "other_hps" and isinstance(value, dict):
        new = {
          k: LogicalCallable(v, f"{site[name]} {k!r}", params_only=False) if _wraps(v) else self(v)
          for k, v in value.items()
        }
        new = value if all(new[k] is value[k] for k in value) else new
      elif name in site:
        new = LogicalCallable(value, site[name]) if _wraps(value) else self(value)
      else:
        new = self(value)
      changed = changed or new is not value
      cells.append(cell if new is value else types.CellType(new))
    if not changed:
      return fn
    out = types.FunctionType(
      fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, tuple(cells)
    )
    out.__kwdefaults__ = fn.__kwdefaults__
    out.__dict__.update(fn.__dict__)
    out.__qualname__ = fn.__qualname__
    return out


def _wraps(value: Any) -> bool:
  """A single callable (not a pytree of flags, a class, or already wrapped)."""
  return (
    callable(value)
    and not isinstance(value, (type, LogicalCallable))
    and not isinstance(value, optax.GradientTransformation)
  )
