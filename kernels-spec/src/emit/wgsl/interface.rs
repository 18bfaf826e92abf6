//! How a WGSL module is described: its bindings in order, its entry points
//! with their launch geometry, and its template. The module's binding
//! declarations and its `Shape` uniform are written from the description
//! ([`Module::declarations`]), the runtime builds the bind group layout and
//! the bind group from it by role, and [`Display`] writes the launch
//! contract.

use super::WgslTiles;
use crate::emit::interface::{Access, Buffer, Elem, Extent, GridTooLarge, Scalar, Sizes};
use std::fmt::{self, Display, Formatter};

/// A tile size of [`WgslTiles`] that launch geometry counts in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Size {
    /// Rows (invocations) per workgroup (`WG`).
    Workgroup,
    /// Query rows staged per tile (`BQ`).
    BlockQ,
    /// Key rows staged per tile (`BKV`).
    BlockKv,
}

impl Display for Size {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Size::Workgroup => "WG",
            Size::BlockQ => "BQ",
            Size::BlockKv => "BKV",
        })
    }
}

/// One binding of group 0; its binding number is its index in
/// [`Module::bindings`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Binding {
    /// `var<uniform> params: Params`, the variant's parameter block.
    Params,
    /// `var<uniform> shape: Shape`, the [`SHAPE`] scalars.
    Shape,
    /// `var<storage, read_write> captures: array<atomic<u32>>`, the call's
    /// capture arena ([`crate::params::Arena`]); every module binds one (a
    /// variant without tensors, only the error words).
    Captures,
    /// `var<storage, read | read_write>` of a tensor.
    Storage(Buffer, Access),
}

/// The scalars of the `shape` uniform, in member order; each is one 32-bit
/// word (`f32` for the scale, else `u32`), and the struct is padded to a
/// multiple of 16 bytes.
pub const SHAPE: &[Scalar] = &[
    Scalar::Batch,
    Scalar::HeadsQ,
    Scalar::HeadsKv,
    Scalar::SeqQ,
    Scalar::SeqK,
    Scalar::Scale,
    Scalar::TileBegin,
    Scalar::TileEnd,
    Scalar::Flags,
    Scalar::KvLens,
    Scalar::QLens,
    Scalar::KvPages,
    Scalar::PageSize,
    Scalar::MaxPages,
    Scalar::Splits,
];

/// Words of the `shape` uniform, padding included.
pub const SHAPE_WORDS: usize = SHAPE.len().next_multiple_of(4);

/// One entry point: a `@compute @workgroup_size(WG)` function, dispatched
/// over consecutive ranges of its tile loop (see [`super::kernels`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    /// The function's name.
    pub name: &'static str,
    /// Workgroups along x and y.
    pub grid: [Extent<Size>; 2],
    /// Iterations of its tile loop over the whole problem.
    pub tiles: Extent<Size>,
}

impl Entry {
    /// Workgroups along x and y for a problem of `sizes`, within WebGPU's
    /// `maxComputeWorkgroupsPerDimension`.
    pub fn workgroups(&self, cfg: &WgslTiles, sizes: &Sizes) -> Result<(u32, u32), GridTooLarge> {
        let size = |s: Size| cfg.size(s);
        let [x, y] = &self.grid;
        Ok((
            x.blocks("x", MAX_WORKGROUPS, sizes, &size)?,
            y.blocks("y", MAX_WORKGROUPS, sizes, &size)?,
        ))
    }

    /// Iterations of the tile loop for a problem of `sizes`.
    pub fn tile_count(&self, cfg: &WgslTiles, sizes: &Sizes) -> u64 {
        self.tiles.eval(sizes, &|s| cfg.size(s))
    }
}

/// `maxStorageBuffersPerShaderStage` that WebGPU guarantees: every module
/// binds at most this many storage buffers.
pub const MAX_STORAGE_BUFFERS: usize = 8;

/// `maxComputeWorkgroupsPerDimension` that WebGPU guarantees.
pub const MAX_WORKGROUPS: u64 = 65535;

/// One WGSL module: its bindings, its entry points (which share them), and
/// the template pieces that make up its code after the shared parts.
#[derive(Clone, Copy, Debug)]
pub struct Module {
    /// A short name for labels and messages.
    pub name: &'static str,
    /// Group 0's bindings, by binding number.
    pub bindings: &'static [Binding],
    /// The entry points, in the order they run.
    pub entries: &'static [Entry],
    /// The templates of its kernels, in order.
    pub templates: &'static [&'static str],
}

fn storage_type(b: Buffer) -> &'static str {
    match b.elem() {
        // The WGSL kernels compute in f32 and take f32 tensors.
        Elem::Input | Elem::F32 => "array<f32>",
        Elem::F32x2 => "array<vec2<f32>>",
        Elem::F32x4 => "array<vec4<f32>>",
    }
}

impl Module {
    /// Its storage buffer bindings (the arena among them).
    pub fn storage_buffers(&self) -> usize {
        self.bindings
            .iter()
            .filter(|b| matches!(b, Binding::Storage(..) | Binding::Captures))
            .count()
    }

    /// The module's declarations of its bindings and of the `Shape` struct.
    pub fn declarations(&self) -> String {
        let mut s = String::from("// ---- bindings ----\nstruct Shape {\n");
        for m in SHAPE {
            let ty = if m.is_float() { "f32" } else { "u32" };
            s.push_str(&format!("    {}: {ty},\n", m.name()));
        }
        for i in SHAPE.len()..SHAPE_WORDS {
            s.push_str(&format!("    pad_{}: u32,\n", i - SHAPE.len()));
        }
        s.push_str("}\n");
        for (i, b) in self.bindings.iter().enumerate() {
            s.push_str(&format!("@group(0) @binding({i}) "));
            s.push_str(&match b {
                Binding::Params => "var<uniform> params: Params;\n".to_string(),
                Binding::Shape => "var<uniform> shape: Shape;\n".to_string(),
                Binding::Captures => {
                    "var<storage, read_write> captures: array<atomic<u32>>;\n".to_string()
                }
                Binding::Storage(buf, access) => format!(
                    "var<storage, {}> {}: {};\n",
                    match access {
                        Access::Read => "read",
                        Access::ReadWrite => "read_write",
                    },
                    buf.name(),
                    storage_type(*buf)
                ),
            });
        }
        s
    }
}

/// The launch contract: bindings, then each entry's workgroups and tiles.
impl Display for Module {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        write!(f, "module {}: bindings", self.name)?;
        for (i, b) in self.bindings.iter().enumerate() {
            let sep = if i == 0 { " " } else { ", " };
            match b {
                Binding::Params => write!(f, "{sep}{i} params (uniform)")?,
                Binding::Shape => write!(f, "{sep}{i} shape (uniform)")?,
                Binding::Captures => write!(f, "{sep}{i} captures (rw)")?,
                Binding::Storage(buf, access) => write!(
                    f,
                    "{sep}{i} {} {}{}",
                    buf.name(),
                    buf.shape(),
                    if *access == Access::Read { "" } else { " (rw)" }
                )?,
            }
        }
        for e in self.entries {
            let [x, y] = &e.grid;
            write!(
                f,
                "; {}: workgroups ({x}, {y}), tile loop of {}",
                e.name, e.tiles
            )?;
        }
        Ok(())
    }
}
