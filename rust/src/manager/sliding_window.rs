//! Sliding-window attention (vLLM's `SlidingWindowManager`): a hit needs enough contiguous
//! cached blocks to fill the window, found right to left; positions left of the window are
//! the null block, and blocks that fall out of the window are freed (spec §6.2).

use crate::error::Result;
use crate::hashing::source::HashSource;
use crate::manager::group_state::{cdiv, resolve_block_hashes, Hit, HitQuery, TypeConfig};
use crate::pool::block_pool::{BlockPool, NULL_BLOCK};

/// `_contiguous_blocks_for_hit`: blocks a hit needs (one more with EAGLE, which drops it).
pub fn contiguous_blocks_for_hit(window: usize, block_size: usize, use_eagle: bool) -> usize {
    cdiv(window - 1, block_size) + use_eagle as usize
}

/// `SlidingWindowManager.find_longest_cache_hit`.
pub fn find_longest_cache_hit(cfg: &TypeConfig, window: usize, pool: &BlockPool, q: &HitQuery<'_>) -> Result<Hit> {
    let block_size = cfg.spec.block_size;
    let a = q.alignment_tokens;
    let hashes = resolve_block_hashes(q.hashes, pool.hash_block_size(), block_size, false, Some(a))?;
    let need = contiguous_blocks_for_hit(window, block_size, q.drop_eagle_block);
    let max_blocks = q.max_length / block_size;
    let n_groups = q.group_ids.len();
    let mut computed: Vec<Vec<u32>> = vec![vec![NULL_BLOCK; max_blocks]; n_groups];
    let mut run = 0usize;
    let mut found = false;
    let mut hit = Vec::with_capacity(n_groups);
    let mut i = max_blocks;
    while i > 0 {
        i -= 1;
        let cached = q.in_hashes(i, hashes.len())? && pool.get_cached_block(hashes.get(i)?, q.group_ids, &mut hit);
        if cached {
            if run == 0 && block_size != a {
                let post_pop = if q.drop_eagle_block { i } else { i + 1 };
                if !(post_pop * block_size).is_multiple_of(a) {
                    continue;
                }
            }
            for (c, &b) in computed.iter_mut().zip(&hit) {
                c[i] = b;
            }
            run += 1;
            if run >= need {
                for c in &mut computed {
                    c.truncate(i + run);
                }
                found = true;
                break;
            }
        } else {
            run = 0;
        }
    }
    let realign = |computed: &mut Vec<Vec<u32>>| {
        while block_size != a && !(computed[0].len() * block_size).is_multiple_of(a) {
            for c in computed.iter_mut() {
                c.pop();
            }
        }
    };
    if !found {
        // the first `run` blocks are a hit even if shorter than the window
        for c in &mut computed {
            c.truncate(run);
        }
        realign(&mut computed);
    }
    if q.drop_eagle_block && !computed[0].is_empty() {
        for c in &mut computed {
            c.pop();
        }
        realign(&mut computed);
    }
    let len = computed[0].len() * block_size;
    Ok((computed, len))
}

/// `SlidingWindowManager.reachable_block_mask`: which blocks of `[start_block, end_block)`
/// can serve a hit at an aligned prefix length (`None`: all of them).
#[allow(clippy::too_many_arguments)] // vLLM's signature
pub fn reachable_block_mask(
    window: usize,
    block_size: usize,
    start_block: usize,
    end_block: usize,
    alignment_tokens: Option<usize>,
    use_eagle: bool,
    retention_interval: Option<usize>,
    reachable_boundaries: &[usize],
    final_segment_end_block: Option<usize>,
) -> Option<Vec<bool>> {
    let a = alignment_tokens?;
    if a % block_size != 0 {
        // a sub-block alignment cannot be represented by a block mask: dense
        return None;
    }
    let need = contiguous_blocks_for_hit(window, block_size, use_eagle);
    let shift = use_eagle as usize;
    let mut mask = vec![false; end_block - start_block];
    let segment_tokens = match retention_interval {
        None => Some(a),
        Some(0) => None,
        Some(r) => Some(r),
    };
    if let Some(seg) = segment_tokens {
        let per_segment = seg / block_size;
        if need >= per_segment {
            return None;
        }
        for i in start_block..end_block {
            if i >= shift && (i - shift) % per_segment >= per_segment - need {
                mask[i - start_block] = true;
            }
        }
        if let (Some(fin), false) = (final_segment_end_block, use_eagle) {
            let size = fin % per_segment;
            if size != 0 {
                let seg_start = fin - size;
                let tail_start = seg_start.max(fin.saturating_sub(need));
                let tail_end = end_block.min(fin);
                for i in start_block.max(tail_start)..tail_end {
                    mask[i - start_block] = true;
                }
            }
        }
    }
    if retention_interval.is_some() {
        for &boundary in reachable_boundaries {
            let aligned = boundary / a * a;
            let end = aligned / block_size + shift;
            let lo = start_block.max(end.saturating_sub(need));
            for j in lo..end_block.min(end) {
                mask[j - start_block] = true;
            }
        }
    }
    Some(mask)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dense_mask_keeps_tails_of_segments() {
        // a 9-token window needs 2 blocks of 4 tokens; alignment 16 tokens (4 blocks a segment)
        let m = reachable_block_mask(9, 4, 0, 8, Some(16), false, None, &[], None).unwrap();
        assert_eq!(m, vec![false, false, true, true, false, false, true, true]);
        // a need at least the segment: every block
        assert!(reachable_block_mask(17, 4, 0, 8, Some(16), false, None, &[], None).is_none());
    }
}
