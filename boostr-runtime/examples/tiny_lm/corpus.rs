//! The training text: sentences from a small grammar, generated from a
//! seed (nothing is downloaded), as characters.

/// A splitmix64 stream: the corpus and the batches are the same on every
/// machine.
pub struct Stream(u64);

impl Stream {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n`.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f32 {
        let u = ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
        let v = ((self.next_u64() >> 11) as f64) / (1u64 << 53) as f64;
        ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
    }

    fn pick<'a>(&mut self, words: &[&'a str]) -> &'a str {
        words[self.below(words.len())]
    }
}

const SUBJECTS: &[&str] = &[
    "the cat",
    "a dog",
    "the old man",
    "my sister",
    "the small bird",
    "a farmer",
    "the teacher",
    "our neighbour",
    "the child",
    "a fox",
];
const VERBS: &[&str] = &[
    "sees", "likes", "chases", "finds", "watches", "feeds", "calls", "follows",
];
const OBJECTS: &[&str] = &[
    "the ball",
    "a red apple",
    "the river",
    "her friend",
    "the green door",
    "a quiet house",
    "the moon",
    "his dog",
];
const PLACES: &[&str] = &[
    "in the garden",
    "by the sea",
    "at night",
    "after dinner",
    "near the hill",
    "every morning",
];

/// About `bytes` characters of sentences: subject, verb, object, and a
/// place every other sentence; a sentence ends in ". ", a paragraph of
/// four in a newline.
pub fn generate(bytes: usize, seed: u64) -> String {
    let mut rng = Stream::new(seed);
    let mut text = String::with_capacity(bytes + 64);
    let mut n = 0;
    while text.len() < bytes {
        text.push_str(rng.pick(SUBJECTS));
        text.push(' ');
        text.push_str(rng.pick(VERBS));
        text.push(' ');
        text.push_str(rng.pick(OBJECTS));
        if rng.below(2) == 0 {
            text.push(' ');
            text.push_str(rng.pick(PLACES));
        }
        n += 1;
        text.push_str(if n % 4 == 0 { ".\n" } else { ". " });
    }
    text
}

/// The characters of a text as token ids, with its alphabet.
pub struct Tokens {
    pub alphabet: Vec<char>,
    pub ids: Vec<i64>,
}

impl Tokens {
    pub fn new(text: &str) -> Self {
        let mut alphabet: Vec<char> = text.chars().collect();
        alphabet.sort_unstable();
        alphabet.dedup();
        let ids = text
            .chars()
            .map(|c| alphabet.binary_search(&c).expect("in the alphabet") as i64)
            .collect();
        Self { alphabet, ids }
    }

    /// A text's ids; a character outside the alphabet is an error.
    pub fn encode(&self, text: &str) -> Result<Vec<i64>, String> {
        text.chars()
            .map(|c| {
                self.alphabet
                    .binary_search(&c)
                    .map(|i| i as i64)
                    .map_err(|_| format!("{c:?} is not in the corpus's alphabet"))
            })
            .collect()
    }

    pub fn decode(&self, ids: &[i64]) -> String {
        ids.iter().map(|&i| self.alphabet[i as usize]).collect()
    }

    /// The entropy of the characters' frequencies, in nats: the loss of the
    /// best model that ignores context.
    pub fn unigram_entropy(&self) -> f64 {
        let mut counts = vec![0usize; self.alphabet.len()];
        for &i in &self.ids {
            counts[i as usize] += 1;
        }
        let n = self.ids.len() as f64;
        counts
            .iter()
            .filter(|&&c| c > 0)
            .map(|&c| {
                let p = c as f64 / n;
                -p * p.ln()
            })
            .sum()
    }
}
