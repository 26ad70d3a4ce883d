//! `KVCacheManagerCore`'s constructor and `_init_python`: the groups, the release rules and
//! the Python-side types a manager is built with.

use super::*;

/// The release rules from their dict (`kvblock.vllm.releases.Release.core_rules()`): each key
/// one [`ReleaseRules`] field, each value a bool; a missing key keeps vLLM 0.33's rule.
fn rules_of(d: &Bound<'_, PyDict>) -> PyResult<ReleaseRules> {
    let mut r = ReleaseRules::default();
    for (k, v) in d.iter() {
        let key: String =
            k.extract().map_err(|_| type_err("release_rules", "keys must be str (ReleaseRules field names)"))?;
        let on: bool = v
            .cast::<pyo3::types::PyBool>()
            .map_err(|_| type_err("release_rules", format!("{key}: expected bool")))
            .map(|b| b.is_true())?;
        match key.as_str() {
            "eagle_groups_drop_always" => r.eagle_groups_drop_always = on,
            "mamba_none_mode_caches" => r.mamba_none_mode_caches = on,
            "partial_tail_rekeyed" => r.partial_tail_rekeyed = on,
            "eagle_junction_block_retained" => r.eagle_junction_block_retained = on,
            "hisparse_trim_null_head" => r.hisparse_trim_null_head = on,
            _ => return Err(value_err("release_rules", format!("unknown rule {key:?}"))),
        }
    }
    Ok(r)
}

/// An optional count among the constructor's extra keywords (None: absent or None).
fn kwarg_count(kwargs: Option<&Bound<'_, PyDict>>, key: &str) -> PyResult<Option<usize>> {
    match kwargs.map(|k| k.get_item(key)).transpose()?.flatten() {
        Some(v) if !v.is_none() => Ok(Some(crate::py::args::count(&v, key)?)),
        _ => Ok(None),
    }
}

/// A group's spec from its dict (see `kvblock.specs`).
fn group_spec(d: &Bound<'_, PyDict>, i: usize) -> PyResult<GroupSpec> {
    let arg = format!("kv_cache_groups[{i}]");
    let get = |k: &str| -> PyResult<Option<Bound<'_, PyAny>>> { d.get_item(k) };
    let int = |k: &str| -> PyResult<Option<usize>> {
        match get(k)? {
            Some(v) if !v.is_none() => Ok(Some(crate::py::args::count(&v, &format!("{arg}.{k}"))?)),
            _ => Ok(None),
        }
    };
    let flag = |k: &str, default: bool| -> PyResult<bool> {
        match get(k)? {
            Some(v) if !v.is_none() => v.is_truthy(),
            _ => Ok(default),
        }
    };
    let kind_name: String = get("kind")?.ok_or_else(|| value_err(&arg, "has no kind"))?.extract()?;
    let need = |k: &str| -> PyResult<usize> {
        int(k)?.ok_or_else(|| value_err(&arg, format!("a {kind_name} group needs {k}")))
    };
    let kind = match kind_name.as_str() {
        "full_attention" => Kind::FullAttention,
        "rswa" => Kind::Rswa { window: need("rswa_window")? },
        "sliding_window" => Kind::SlidingWindow {
            window: need("sliding_window")?,
            extra_retained_tokens: int("extra_retained_tokens")?.unwrap_or(0),
        },
        "chunked_local_attention" => Kind::ChunkedLocal { chunk: need("attention_chunk_size")? },
        "mamba" => {
            let mode: String = match get("mamba_cache_mode")? {
                Some(v) if !v.is_none() => v.extract()?,
                _ => "none".into(),
            };
            let mode = match mode.as_str() {
                "none" => MambaMode::None,
                "align" => MambaMode::Align,
                m => {
                    return Err(value_err(
                        &arg,
                        format!("unknown mamba_cache_mode {m:?} (kvblock supports 'none' and 'align')"),
                    ))
                }
            };
            Kind::Mamba {
                mode,
                num_speculative_blocks: int("num_speculative_blocks")?.unwrap_or(0),
                num_prefill_checkpoint_blocks: int("num_prefill_checkpoint_blocks")?.unwrap_or(0),
                prefill_checkpoint_alignment: int("prefill_checkpoint_alignment")?,
            }
        }
        "cross_attention" => Kind::CrossAttention,
        "circular_buffer" => Kind::CircularBuffer,
        "hisparse_source" => Kind::HiSparseSource,
        "hisparse_resident" => Kind::HiSparseResident,
        "hisparse_hot" => Kind::HiSparseHot { blocks_per_request: need("blocks_per_request")? },
        k => return Err(value_err(&arg, format!("kvblock does not manage {k:?} groups"))),
    };
    let attention = !matches!(kind, Kind::Mamba { .. });
    // HiSparse's resident and hot specs are never prefix-cacheable (their `prefix_cacheable`)
    let cacheable = !matches!(kind, Kind::CircularBuffer | Kind::HiSparseResident | Kind::HiSparseHot { .. });
    Ok(GroupSpec {
        kind,
        block_size: need("block_size")?,
        prefix_cacheable: flag("prefix_cacheable", cacheable)?,
        dcp_sharded: flag("dcp_sharded", attention)?,
        is_eagle_group: flag("is_eagle_group", false)?,
        zeroed: flag("zeroed", attention && !matches!(kind, Kind::CircularBuffer))?,
        spec_class: int("spec_class")?.unwrap_or(i) as u32,
    })
}

/// `e` as vLLM's constructors raise it for `caller`: for [`Caller::Vllm`] a `ValueError`
/// (any subclass) becomes an `AssertionError` with the same message, as vLLM asserts what
/// kvblock's API refuses with a `ValueError`; anything else passes through.
fn asserted_for(caller: Caller, py: Python<'_>, e: PyErr) -> PyErr {
    if caller == Caller::Vllm && e.is_instance_of::<pyo3::exceptions::PyValueError>(py) {
        pyo3::exceptions::PyAssertionError::new_err(e.value(py).to_string())
    } else {
        e
    }
}

#[pymethods]
impl PyManager {
    #[new]
    #[pyo3(signature = (block_pool, kv_cache_groups, max_model_len, scheduler_block_size, hash_block_size, *, max_in_flight_tokens=None, enable_caching=true, use_eagle=false, num_hash_lookahead_tokens=None, num_prefill_lookahead=None, dcp_world_size=None, pcp_world_size=None, watermark_blocks=None, needs_kv_cache_zeroing=false, retention_interval=None, enable_mamba_shared_prefix_checkpoint=false, caller="vllm", priority_retention=false, default_retention_priority=None, decay_granularity_s=1.0, clock=None, max_pinned_fraction=0.0, verify_hits=false, hit_extra_keys=None, release_rules=None, **_kwargs))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        block_pool: Bound<'_, PyBlockPool>,
        kv_cache_groups: &Bound<'_, PyAny>,
        max_model_len: &Bound<'_, PyAny>,
        scheduler_block_size: &Bound<'_, PyAny>,
        hash_block_size: &Bound<'_, PyAny>,
        max_in_flight_tokens: Option<&Bound<'_, PyAny>>,
        enable_caching: bool,
        use_eagle: bool,
        num_hash_lookahead_tokens: Option<&Bound<'_, PyAny>>,
        num_prefill_lookahead: Option<&Bound<'_, PyAny>>,
        dcp_world_size: Option<&Bound<'_, PyAny>>,
        pcp_world_size: Option<&Bound<'_, PyAny>>,
        watermark_blocks: Option<&Bound<'_, PyAny>>,
        needs_kv_cache_zeroing: bool,
        retention_interval: Option<&Bound<'_, PyAny>>,
        enable_mamba_shared_prefix_checkpoint: bool,
        caller: &str,
        priority_retention: bool,
        default_retention_priority: Option<&Bound<'_, PyAny>>,
        decay_granularity_s: f64,
        clock: Option<Py<PyAny>>,
        max_pinned_fraction: f64,
        verify_hits: bool,
        hit_extra_keys: Option<Py<PyAny>>,
        release_rules: Option<&Bound<'_, PyDict>>,
        _kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        use crate::py::args::count as c;
        let or = |v: Option<&Bound<'_, PyAny>>, arg: &str, d: usize| -> PyResult<usize> {
            match v {
                Some(v) if !v.is_none() => c(v, arg),
                _ => Ok(d),
            }
        };
        let py = block_pool.py();
        let caller = match caller {
            "kvblock" => Caller::Kvblock,
            "vllm" => Caller::Vllm,
            other => return Err(value_err("caller", format!("expected 'kvblock' or 'vllm', got {other:?}"))),
        };
        // reading the arguments: what kvblock's API refuses with a ValueError, vLLM's
        // constructors assert (mapped by type in `asserted_for`, never by message)
        let read = || -> PyResult<(ManagerConfig, Option<i64>, u8)> {
            let mut groups = Vec::new();
            for (i, g) in kv_cache_groups.try_iter()?.enumerate() {
                let g = g?;
                let d =
                    g.cast::<PyDict>().map_err(|_| type_err("kv_cache_groups", "expected a list of group dicts"))?;
                groups.push(group_spec(d, i)?);
            }
            let max_model_len = c(max_model_len, "max_model_len")?;
            let retention = match retention_interval {
                Some(r) if !r.is_none() => Some(crate::py::args::int64(r, "prefix_cache_retention_interval")?),
                _ => None,
            };
            let (num_blocks, pool_h, pool_caching) = {
                let p = block_pool.get().state.borrow(py)?;
                (p.inner.num_blocks(), p.inner.hash_block_size(), p.inner.enable_caching())
            };
            let cfg = ManagerConfig {
                groups,
                num_blocks,
                max_model_len,
                max_in_flight_tokens: match max_in_flight_tokens {
                    Some(m) if !m.is_none() => c(m, "max_in_flight_tokens")?,
                    _ => max_model_len,
                },
                scheduler_block_size: c(scheduler_block_size, "scheduler_block_size")?,
                hash_block_size: c(hash_block_size, "hash_block_size")?,
                enable_caching,
                use_eagle,
                num_hash_lookahead_tokens: or(num_hash_lookahead_tokens, "num_hash_lookahead_tokens", 0)?,
                num_prefill_lookahead: or(num_prefill_lookahead, "num_prefill_lookahead", 0)?,
                dcp_world_size: or(dcp_world_size, "dcp_world_size", 1)?,
                pcp_world_size: or(pcp_world_size, "pcp_world_size", 1)?,
                watermark_blocks: or(watermark_blocks, "watermark_blocks", 0)?,
                enable_kv_cache_events: false,
                needs_kv_cache_zeroing,
                retention_interval: retention.map(|v| v.max(0) as usize),
                enable_mamba_shared_prefix_checkpoint,
                caller,
                rules: ReleaseRules::default(),
                hisparse_host_num_blocks: kwarg_count(_kwargs, "hisparse_host_num_blocks")?,
                hisparse_import_step_tokens: kwarg_count(_kwargs, "hisparse_import_step_tokens")?,
            };
            if pool_h != cfg.hash_block_size {
                return Err(value_err(
                    "hash_block_size",
                    format!("{} differs from the pool's hash_block_size {pool_h}", cfg.hash_block_size),
                ));
            }
            if pool_caching != enable_caching {
                return Err(value_err("enable_caching", "must match the pool's"));
            }
            let default_prio = match default_retention_priority {
                Some(d) if !d.is_none() => crate::py::retention::priority_of(d, "default_retention_priority")?,
                _ => crate::pool::retention::DEFAULT_PRIORITY,
            };
            if !(0.0..=1.0).contains(&max_pinned_fraction) {
                return Err(value_err("max_pinned_fraction", format!("{max_pinned_fraction} must be in [0, 1]")));
            }
            if clock.as_ref().is_some_and(|c| !c.bind(py).is_callable()) {
                return Err(type_err("clock", "must be a callable returning seconds"));
            }
            Ok((cfg, retention, default_prio))
        };
        let (mut cfg, retention, default_prio) = read().map_err(|e| asserted_for(caller, py, e))?;
        // kvblock's own argument (kvblock.vllm.releases), not vLLM's: its errors as they are
        if let Some(d) = release_rules {
            cfg.rules = rules_of(d)?;
        }
        if let Some(v) = retention.filter(|&v| v < 0) {
            return Err(cfg.refused(
                "prefix_cache_retention_interval",
                format!("({v}) must be non-negative and a multiple of scheduler_block_size"),
            ))
            .py_err();
        }
        let mut inner = KVCacheManager::new(&cfg).py_err()?;
        let reader = if verify_hits {
            let extra_keys = hit_extra_keys.filter(|f| f.bind(py).is_callable()).ok_or_else(|| {
                type_err("hit_extra_keys", "verify_hits needs the per-block extra keys function (a callable)")
            })?;
            inner.enable_hit_verification(cfg.num_blocks).py_err()?;
            Some(ContentReader {
                block_size: cfg.hash_block_size,
                lookahead: cfg.num_hash_lookahead_tokens,
                extra_keys,
            })
        } else {
            None
        };
        if inner.coord.hisparse().is_some() {
            let mut p = block_pool.get().state.borrow_mut(py)?;
            inner.coord.bind_device_pool(&mut p.inner);
            p.keep_every_tag();
        }
        inner.retention.max_pinned_blocks = (max_pinned_fraction * (cfg.num_blocks - 1) as f64).floor() as usize;
        if priority_retention {
            let mut p = block_pool.get().state.borrow_mut(py)?;
            p.inner.enable_retention(default_prio, decay_granularity_s).py_err()?;
        }
        // the id API (`lookup_prefix`, `cache_ids`) refuses a group id past this manager's
        block_pool.get().state.borrow_mut(py)?.set_num_groups(inner.coord.num_groups() as u32);
        let state = ManagerState {
            pool: block_pool.unbind(),
            inner,
            empty: None,
            empty_blocks: None,
            make_blocks: None,
            waiting_states: None,
            fields: RequestFields::generic(py),
            hit_limit: HitLimit::SkipFlag,
            clock,
            slots: SlotCache::default(),
            boundary_calls: [0; 2],
            reader,
        };
        Ok(PyManager { state: GilCell::new(state, "KVCacheManagerCore") })
    }

    /// Install the Python helpers: the shared empty `KVCacheBlocks`, the result type, the
    /// request states the watermark applies to, and the request type read fast.
    #[pyo3(signature = (empty, blocks_type, waiting, preempted, request_type, hit_limit_field="skip_reading_prefix_cache"))]
    #[allow(clippy::too_many_arguments)]
    fn _init_python(
        &self,
        py: Python<'_>,
        empty: Py<PyAny>,
        blocks_type: &Bound<'_, PyType>,
        waiting: Py<PyAny>,
        preempted: Py<PyAny>,
        request_type: &Bound<'_, PyType>,
        hit_limit_field: &str,
    ) -> PyResult<()> {
        let hit_limit = match hit_limit_field {
            "skip_reading_prefix_cache" => HitLimit::SkipFlag,
            "prefix_cache_hit_limit" => HitLimit::TokenLimit,
            other => {
                return Err(value_err(
                    "hit_limit_field",
                    format!("expected 'skip_reading_prefix_cache' or 'prefix_cache_hit_limit', got {other:?}"),
                ))
            }
        };
        let mut me = self.state.borrow_mut(py)?;
        me.hit_limit = hit_limit;
        me.empty_blocks = Some(empty.bind(py).getattr("blocks")?.unbind());
        me.empty = Some(empty);
        me.make_blocks = Some(SlotFactory::new(blocks_type, &["_ids", "_pool", "_blocks"])?);
        me.waiting_states = Some((waiting, preempted));
        let fields = RequestFields::for_type(request_type)?;
        me.fields = if me.inner.caller.is_kvblock() { fields } else { fields.with_attribute_errors() };
        Ok(())
    }
}
