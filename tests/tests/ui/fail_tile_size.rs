use boostr_runtime::attention;

#[attention(score = |s, _b, _h, _q, _kv| s, tile(q = 0, kv = 64))]
#[derive(Clone, Debug)]
struct TileSize;

fn main() {}
