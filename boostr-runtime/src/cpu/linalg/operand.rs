//! The operands of the CPU kernels as stored: `[B, H, S, dim]` tensors (or
//! a KV cache's `[pages, H, page_size, dim]`) whose rows are each
//! contiguous, with batches, heads and rows any distance apart.
//!
//! So the kernels read in place what model code holds: a `[B, S, H, D]`
//! projection permuted to `[B, H, S, D]` (rows `H·D` apart, heads `D`), V
//! as the first `Dv` columns of K's rows (MLA's absorbed decode: rows `D`
//! apart), a head-sliced or head-broadcast tensor (heads 0 apart). A
//! kernel takes one (batch, head) at a time as [`Rows`], and moves rows
//! into its tiles through [`Rows::transpose`] and [`Rows::widen`], or hands
//! f32 rows to the tile products with their stride ([`Rows::f32`]).

use crate::cpu::elem::{self, Stored};

/// A `[batch, heads, rows, dim]` operand as stored: row `(b, h, s)` is the
/// `dim` elements from `b·strides[0] + h·strides[1] + s·strides[2]`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Operand<'a> {
    data: Stored<'a>,
    shape: [usize; 4],
    strides: [usize; 3],
    /// An fp8 cache's dequantization scales: one per head (`heads`
    /// values), or per batch (page) and head.
    scales: Option<&'a [f32]>,
}

impl<'a> Operand<'a> {
    /// All of `data` as contiguous `[.., heads, rows, dim]`.
    pub(crate) fn packed(data: Stored<'a>, [heads, rows, dim]: [usize; 3]) -> Self {
        let batches = data.len() / (heads * rows * dim).max(1);
        let shape = [batches, heads, rows, dim];
        Self::new(data, shape, [heads * rows * dim, rows * dim, dim])
    }

    /// `data` holding `shape` with the given strides (in elements) of
    /// batches, heads and rows.
    ///
    /// # Panics
    /// If rows overlap (`strides[2] < dim` with more than one row) or an
    /// element lies past `data`.
    pub(crate) fn new(data: Stored<'a>, shape: [usize; 4], strides: [usize; 3]) -> Self {
        assert!(shape[2] <= 1 || strides[2] >= shape[3], "rows overlap");
        assert!(
            Self::span(shape, strides) <= data.len(),
            "operand past its data"
        );
        Self {
            data,
            shape,
            strides,
            scales: None,
        }
    }

    /// The operand with each stored value worth `scales[h]` times its own
    /// (`heads` scales) or `scales[b·heads + h]` (`batch · heads`).
    ///
    /// # Panics
    /// If there are neither.
    pub(crate) fn with_scales(self, scales: &'a [f32]) -> Self {
        let [n, h, _, _] = self.shape;
        assert!(
            scales.len() == h || scales.len() == n * h,
            "a scale per head"
        );
        Self {
            scales: Some(scales),
            ..self
        }
    }

    /// Elements from the first to one past the last (0 when empty).
    pub(crate) fn span(shape: [usize; 4], strides: [usize; 3]) -> usize {
        if shape.contains(&0) {
            return 0;
        }
        (0..3).map(|i| (shape[i] - 1) * strides[i]).sum::<usize>() + shape[3]
    }

    /// `[batch, heads, rows, dim]`.
    pub(crate) fn shape(self) -> [usize; 4] {
        self.shape
    }

    /// The elements of each row.
    pub(crate) fn dim(self) -> usize {
        self.shape[3]
    }

    /// The rows of head `h` of batch `b` (or page `b` of a cache).
    ///
    /// # Panics
    /// If `b` or `h` is out of range.
    pub(crate) fn at(self, b: usize, h: usize) -> Rows<'a> {
        assert!(b < self.shape[0] && h < self.shape[1], "head out of range");
        let start = b * self.strides[0] + h * self.strides[1];
        let rows = Rows::new(
            self.data.slice(start..self.data.len()),
            self.shape[2],
            self.shape[3],
            self.strides[2],
        );
        match self.scales {
            Some(s) if s.len() == self.shape[1] => rows.scaled(s[h]),
            Some(s) => rows.scaled(s[b * self.shape[1] + h]),
            None => rows,
        }
    }

    /// The rows of flat (batch, head) index `bh = b·heads + h`.
    pub(crate) fn head(self, bh: usize) -> Rows<'a> {
        let heads = self.shape[1].max(1);
        self.at(bh / heads, bh % heads)
    }

    /// The operand as one contiguous slice, where it is one.
    pub(crate) fn contiguous(self) -> Option<Stored<'a>> {
        let [n, h, s, d] = self.shape;
        let packed = [h * s * d, s * d, d];
        // The stride of a dim of extent 1 is never used.
        let same = |i: usize, extent: usize| extent <= 1 || self.strides[i] == packed[i];
        (same(0, n) && same(1, h) && same(2, s)).then(|| self.data.slice(0..n * h * s * d))
    }

    /// Every row as f32, contiguous, into `dst` (`batch·heads·rows·dim`).
    pub(crate) fn widen(self, dst: &mut [f32]) {
        let [n, h, s, d] = self.shape;
        assert_eq!(dst.len(), n * h * s * d, "widen lengths");
        for (bh, dst) in dst.chunks_exact_mut((s * d).max(1)).enumerate() {
            self.head(bh).widen(dst);
        }
    }
}

/// `count` rows of `dim` elements, `stride` apart, as stored; each value
/// is worth `scale` times the stored one (fp8 caches; 1 otherwise).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Rows<'a> {
    /// From the first element of the first row to (at least) the last
    /// element of the last.
    data: Stored<'a>,
    count: usize,
    dim: usize,
    stride: usize,
    scale: f32,
}

impl<'a> Rows<'a> {
    /// # Panics
    /// If the rows overlap or do not fit in `data`.
    pub(crate) fn new(data: Stored<'a>, count: usize, dim: usize, stride: usize) -> Self {
        assert!(count <= 1 || stride >= dim, "rows overlap");
        // One row's stride is never used: make it the packed one.
        let stride = if count <= 1 { dim } else { stride };
        let span = Self::span(count, dim, stride);
        assert!(span <= data.len(), "rows past the data");
        Self {
            data: data.slice(0..span),
            count,
            dim,
            stride,
            scale: 1.0,
        }
    }

    /// The rows with each value worth `scale` times the stored one.
    pub(crate) fn scaled(self, scale: f32) -> Self {
        Self { scale, ..self }
    }

    /// What each stored value is multiplied by.
    pub(crate) fn scale(self) -> f32 {
        self.scale
    }

    /// Contiguous rows of `dim` (all of `data`).
    pub(crate) fn packed(data: Stored<'a>, dim: usize) -> Self {
        let count = data.len() / dim.max(1);
        Self::new(data, count, dim, dim)
    }

    fn span(count: usize, dim: usize, stride: usize) -> usize {
        if count == 0 {
            0
        } else {
            (count - 1) * stride + dim
        }
    }

    /// Rows held.
    pub(crate) fn len(self) -> usize {
        self.count
    }

    /// Elements between consecutive rows.
    pub(crate) fn stride(self) -> usize {
        self.stride
    }

    /// Elements per row.
    pub(crate) fn dim(self) -> usize {
        self.dim
    }

    /// The elements from the first row's first to the last row's last.
    pub(crate) fn data(self) -> Stored<'a> {
        self.data
    }

    /// Rows `r`.
    pub(crate) fn sub(self, r: std::ops::Range<usize>) -> Self {
        assert!(r.start <= r.end && r.end <= self.count, "rows out of range");
        let at = r.start * self.stride;
        let span = Self::span(r.len(), self.dim, self.stride);
        Self {
            data: self.data.slice(at..at + span),
            count: r.len(),
            ..self
        }
    }

    /// Row `i`.
    pub(crate) fn row(self, i: usize) -> Stored<'a> {
        assert!(i < self.count, "row out of range");
        self.data.slice(i * self.stride..i * self.stride + self.dim)
    }

    /// The rows as one contiguous block, where they are one.
    pub(crate) fn packed_data(self) -> Option<Stored<'a>> {
        (self.count <= 1 || self.stride == self.dim).then_some(self.data)
    }

    /// f32 rows (unscaled) as the tile products take them: the elements
    /// from the first row's and the row stride.
    pub(crate) fn f32(self) -> Option<(&'a [f32], usize)> {
        let x = self.data.as_f32().filter(|_| self.scale == 1.0)?;
        Some((x, self.stride))
    }

    /// Bytes from the first row's first element to the last row's last.
    pub(crate) fn span_bytes(self) -> &'a [u8] {
        self.data.as_bytes()
    }

    /// Bytes per element.
    pub(crate) fn elem_bytes(self) -> usize {
        self.data.elem_bytes()
    }

    /// `dst` (`count × dim`, contiguous) = the rows as f32.
    ///
    /// # Panics
    /// If `dst` does not hold exactly `count · dim` elements.
    pub(crate) fn widen(self, dst: &mut [f32]) {
        assert_eq!(dst.len(), self.count * self.dim, "widen lengths");
        match self.packed_data() {
            Some(data) => elem::widen(data, dst),
            None => {
                for (i, dst) in dst.chunks_exact_mut(self.dim.max(1)).enumerate() {
                    elem::widen(self.row(i), dst);
                }
            }
        }
        if self.scale != 1.0 {
            dst.iter_mut().for_each(|x| *x *= self.scale);
        }
    }

    /// The f32 transpose of the rows into `dst` (`dim × count`, row stride
    /// `dst_rs`), as [`elem::transpose`].
    pub(crate) fn transpose(self, dst: &mut [f32], dst_rs: usize) {
        elem::transpose(self.data, (self.count, self.dim, self.stride), dst, dst_rs);
        if self.scale != 1.0 {
            for row in dst.chunks_mut(dst_rs.max(1)).take(self.dim) {
                row[..self.count].iter_mut().for_each(|x| *x *= self.scale);
            }
        }
    }

    /// Whether these rows are the leading `dim` columns of `whole`'s rows
    /// (V as a view of K in absorbed MLA): the same first element, rows,
    /// stride, element type and scale.
    pub(crate) fn leads(self, whole: Rows<'_>) -> bool {
        self.count == whole.count
            && self.stride == whole.stride
            && self.dim <= whole.dim
            && self.scale == whole.scale
            && std::mem::discriminant(&self.data) == std::mem::discriminant(&whole.data)
            && self.data.as_bytes().as_ptr() == whole.data.as_bytes().as_ptr()
    }

    /// Whether every element of every row is finite.
    pub(crate) fn all_finite(self) -> bool {
        match self.packed_data() {
            Some(data) => data.all_finite(),
            None => (0..self.count).all(|i| self.row(i).all_finite()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_of_a_permuted_layout_are_found_in_place() {
        // [B=2, S=3, H=2, D=4] read as [B, H, S, D].
        let (b, s, h, d) = (2, 3, 2, 4);
        let x: Vec<f32> = (0..b * s * h * d).map(|i| i as f32).collect();
        let op = Operand::new(Stored::F32(&x), [b, h, s, d], [s * h * d, d, h * d]);
        assert!(op.contiguous().is_none());
        for bi in 0..b {
            for hi in 0..h {
                let rows = op.at(bi, hi);
                assert_eq!(op.head(bi * h + hi).len(), s);
                let mut wide = vec![f32::NAN; s * d];
                rows.widen(&mut wide);
                let mut t = vec![f32::NAN; d * (s + 1)];
                rows.transpose(&mut t, s + 1);
                for si in 0..s {
                    for di in 0..d {
                        let want = x[((bi * s + si) * h + hi) * d + di];
                        assert_eq!(wide[si * d + di], want);
                        assert_eq!(t[di * (s + 1) + si], want);
                    }
                }
                let tail = rows.sub(1..3);
                assert_eq!(
                    tail.row(0).as_f32().unwrap()[0],
                    x[((bi * s + 1) * h + hi) * d]
                );
            }
        }
        let packed = Operand::packed(Stored::F32(&x), [h * s, 1, d]);
        assert!(packed.contiguous().is_some());
        let mut all = vec![f32::NAN; x.len()];
        op.widen(&mut all);
        assert_eq!(all[d..2 * d], x[h * d..(h + 1) * d], "head 0's second row");
    }
}
