//! How a sequence is cut into the ranks' shards.

use crate::error::{Error, Result};
use numr::ops::ShapeOps;
use numr::runtime::Runtime;
use numr::tensor::Tensor;

/// How the `S` positions of the sequence are spread over `world` ranks,
/// each holding `S / world` of them (its shard of q, k and v, in position
/// order).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Shards {
    /// Rank `r` holds positions `r·n .. (r+1)·n` (`n = S / world`). Under
    /// a causal mask rank `r` has `r + ½` shards of work, so the last rank
    /// sets the pace: prefer [`Zigzag`](Shards::Zigzag) for causal masks.
    #[default]
    Contiguous,
    /// The sequence in `2·world` chunks of `c = n / 2`: rank `r` holds
    /// chunks `r` and `2·world − 1 − r`, one early and one late, so that a
    /// causal mask gives every rank the same work (`n` must be even).
    Zigzag,
}

/// A run of a shard's rows that lie together in the sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Chunk {
    /// Its first row in the shard.
    pub row: usize,
    /// The global position of that row.
    pub start: usize,
    /// Rows.
    pub len: usize,
}

impl Shards {
    /// The layout's code in the ranks' header.
    pub(crate) fn code(self) -> u64 {
        match self {
            Shards::Contiguous => 1,
            Shards::Zigzag => 2,
        }
    }

    /// The chunks of rank `rank`'s shard of `n` rows, in row order, runs
    /// that are adjacent in the sequence joined (the middle rank of a
    /// zigzag holds one run): one kernel call covers each.
    pub(crate) fn chunks(self, rank: usize, world: usize, n: usize) -> Vec<Chunk> {
        let pieces = match self {
            Shards::Contiguous => vec![(rank * n, n)],
            Shards::Zigzag => {
                let c = n / 2;
                vec![(rank * c, c), ((2 * world - 1 - rank) * c, c)]
            }
        };
        let mut chunks: Vec<Chunk> = Vec::with_capacity(pieces.len());
        let mut row = 0;
        for (start, len) in pieces {
            match chunks.last_mut() {
                Some(last) if last.start + last.len == start => last.len += len,
                _ => chunks.push(Chunk { row, start, len }),
            }
            row += len;
        }
        chunks
    }

    /// The rule a shard of `n` rows breaks under this layout, if any.
    pub(crate) fn check(self, n: usize) -> Result<()> {
        if self == Shards::Zigzag && !n.is_multiple_of(2) {
            return Err(Error::Ring {
                rule: "a zigzag shard holds two chunks of equal length, so its length must be even",
                got: format!("a shard of {n} rows"),
            });
        }
        Ok(())
    }

    /// Rank `rank`'s shard of `x [.., S, ..]` along `dim` (the sequence
    /// dim), contiguous: what the rank passes to
    /// [`ring_attention`](crate::ring_attention) for `q`, `k` or `v` of
    /// the whole sequence. `S` must be divisible by `world` (by
    /// `2·world` for [`Zigzag`](Shards::Zigzag)).
    pub fn shard<R: Runtime>(
        self,
        x: &Tensor<R>,
        dim: usize,
        rank: usize,
        world: usize,
    ) -> Result<Tensor<R>>
    where
        R::Client: ShapeOps<R>,
    {
        let s = *x.shape().get(dim).ok_or_else(|| Error::Ring {
            rule: "the sequence dim must be a dim of the tensor",
            got: format!("dim {dim} of shape {:?}", x.shape()),
        })?;
        let parts = match self {
            Shards::Contiguous => world,
            Shards::Zigzag => 2 * world,
        };
        if world == 0 || rank >= world || s % parts != 0 {
            return Err(Error::Ring {
                rule: "the sequence splits into equal shards (2·world chunks for zigzag) and rank < world",
                got: format!("S = {s}, world {world}, rank {rank}"),
            });
        }
        let n = s / world;
        let pieces = self
            .chunks(rank, world, n)
            .into_iter()
            .map(|c| x.narrow(dim as isize, c.start, c.len))
            .collect::<numr::error::Result<Vec<_>>>()?;
        let refs: Vec<&Tensor<R>> = pieces.iter().collect();
        Ok(Tensor::cat(&refs, dim as isize)?.contiguous()?)
    }

    /// The whole sequence from every rank's shard (in rank order) along
    /// `dim`: the inverse of [`shard`](Shards::shard).
    pub fn unshard<R: Runtime>(self, shards: &[Tensor<R>], dim: usize) -> Result<Tensor<R>>
    where
        R::Client: ShapeOps<R>,
    {
        let world = shards.len();
        let n = shards
            .first()
            .and_then(|t| t.shape().get(dim).copied())
            .ok_or_else(|| Error::Ring {
                rule: "at least one shard, with the sequence dim",
                got: format!("{world} shards"),
            })?;
        self.check(n)?;
        let mut pieces: Vec<(usize, Tensor<R>)> = Vec::new();
        for (rank, t) in shards.iter().enumerate() {
            for c in self.chunks(rank, world, n) {
                pieces.push((c.start, t.narrow(dim as isize, c.row, c.len)?));
            }
        }
        pieces.sort_by_key(|(start, _)| *start);
        let refs: Vec<&Tensor<R>> = pieces.iter().map(|(_, t)| t).collect();
        Ok(Tensor::cat(&refs, dim as isize)?.contiguous()?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zigzag_chunks_pair_an_early_and_a_late_chunk() {
        let chunks = Shards::Zigzag.chunks(1, 3, 8);
        assert_eq!(
            chunks,
            [
                Chunk {
                    row: 0,
                    start: 4,
                    len: 4
                },
                Chunk {
                    row: 4,
                    start: 16,
                    len: 4
                }
            ]
        );
        // Every position is held once.
        let mut runs: Vec<(usize, usize)> = (0..3)
            .flat_map(|r| Shards::Zigzag.chunks(r, 3, 8))
            .map(|c| (c.start, c.len))
            .collect();
        runs.sort();
        assert_eq!(runs, [(0, 4), (4, 4), (8, 8), (16, 4), (20, 4)]);
        // The middle rank's two chunks are one run.
        assert_eq!(
            Shards::Zigzag.chunks(2, 3, 8),
            [Chunk {
                row: 0,
                start: 8,
                len: 8
            }]
        );
    }
}
