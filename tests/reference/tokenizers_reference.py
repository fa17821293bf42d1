#!/usr/bin/env python3
"""Test tokenizers of each family and what Hugging Face's libraries make of a varied corpus: the reference for
tests/client_runtime/text/tokenizer_test.cpp.

  tokenizers_reference.py --output DIR

Trains, on a small built-in corpus, one tokenizer per family, configured as that family's real checkpoint is
(read from the tokenizer.json files the Hub serves), and writes each into DIR/<family>/ as a checkpoint holds it:
  gpt2       tokenizer.json: ByteLevel pre-tokenizer (GPT-2's regex), ByteLevel decoder, <|endoftext|>
  llama3     tokenizer.json: Split (Llama 3's regex) + ByteLevel(use_regex=false), BPE with ignore_merges,
             TemplateProcessing with <|begin_of_text|>, reserved special tokens
  qwen2      tokenizer.json: NFC normalizer, Split (Qwen2's regex, single digits) + ByteLevel(use_regex=false),
             <|endoftext|>, <|im_start|>, <|im_end|>
  starcoder  tokenizer.json: Digits(individual_digits) + ByteLevel, <|endoftext|>, <fim_prefix>, ...
  lowercase  tokenizer.json: NFKC and Lowercase normalizers, ByteLevel (special casing: İ, final sigma, ǅ)
  spm_bpe    tokenizer.model: SentencePiece BPE with byte fallback (Llama 2, Mistral), add_bos_token
  spm_bpe_legacy  the same trained with user-defined pieces (<sep>, <|user|>), legacy true
  spm_bpe_no_prefix  the same with add_prefix_space false
  spm_unigram tokenizer.model: SentencePiece unigram, named LlamaTokenizer (transformers makes BPE of it)
  llama2_json tokenizer.json: what transformers converts spm_bpe's model to (Metaspace, BPE with byte fallback),
             LlamaTokenizer with legacy false
  llama2_legacy_json  the same with the Prepend/Replace normalizer of Llama 2's checkpoints on the Hub, and
             legacy true
  gemma_spm  tokenizer.model: SentencePiece BPE trained with Gemma's options (no dummy prefix, <pad> <eos> <bos>
             <unk> first, <mask> and the turn markers user-defined, byte fallback, digits split), GemmaTokenizer
             with add_bos_token, and legacy true (which Gemma's class ignores)
  gemma_spm_eos  the same without <pad> and <mask> (transformers appends them), GemmaTokenizerFast with
             add_eos_token and without add_bos_token
  gemma_json tokenizer.json: what transformers converts gemma_spm's model to (Replace(" ", "▁") normalizer, BPE
             with byte fallback and <unk>), GemmaTokenizer
  gemma_rewritten_json  the same file in Llama 2's form (Metaspace splitting at every space, no normalizer, no
             byte fallback) and adding EOS, not BOS, under GemmaTokenizer: the class rebuilds the pipeline, so read
             as written it would tokenize otherwise
each with tokenizer_config.json. DIR/expected.json holds, per family, the cases
  {"text", "ids" (tokenizer(text) as transformers adds special tokens), "ids_plain" (add_special_tokens=False),
   "decoded" (decode(ids)), "decoded_skip" (decode(ids, skip_special_tokens=True))}
for every corpus text, and decode-only cases {"ids", "decoded", "decoded_skip"} of random ids (pieces of UTF-8
characters among them), with "bos", "eos" and "vocab_size".
Every family's reference is transformers' AutoTokenizer (which runs the file as written for
PreTrainedTokenizerFast, and builds LlamaTokenizer's and GemmaTokenizer's pipelines itself: [Tokenizer classes] in
client_runtime/text/tokenizer_json.cpp); a tokenizer.model alone is converted by AutoTokenizer too
([SentencePiece conversion] in client_runtime/text/sentencepiece_model.h).
Exit status 3 when a Python package is missing (the C++ test then skips).
"""
import argparse
import json
import os
import random
import sys

from reference import missing

# What the tokenizers are trained on: prose, code, numbers and several scripts, so that merges span bytes of
# multi-byte characters too.
TRAINING = [
    "The quick brown fox jumps over the lazy dog. It's what they'll say; we've seen it, I'm sure, you'd agree.",
    "def tokenize(text: str) -> list[int]:\n    return [ord(c) for c in text]  # 1234567890\n",
    "for (int i = 0; i < 100; ++i) { total += values[i] * 3.14159; }\n\tif (x != y) return -1;",
    "日本語のテキストを分割します。中文文本也需要分词。한국어 텍스트도 있습니다.",
    "Café, naïve, résumé, Ångström, Straße, œuvre, façade — «quotes» and “smart quotes”.",
    "Emoji: 🎉🚀👍🏽 👨‍👩‍👧 ❤️ and symbols ∑ ∫ √ ≤ ≥ ± × ÷ € £ ¥.",
    "Numbers 2024-01-15 12:30:45, 3.5%, $1,000,000 and 0xDEADBEEF; phone +1 (555) 123-4567.",
    "Русский текст, ελληνικά, עברית, العربية, हिन्दी, ไทย.",
    "   indented    with   runs of    spaces\n\n\nand newlines\r\nand tabs\t\tend",
    "<html><body class=\"main\">Hello, World!</body></html> {\"key\": [1, 2, 3], \"null\": null}",
]

# What is compared: each family's reference against ours on every text.
CORPUS = [
    "",
    "Hello world",
    " Hello world",
    "Hello  world   with    spaces",
    "The quick brown fox jumps over the lazy dog.",
    "It's they'll we've I'M YOU'D He'S",
    "line one\nline two\n\nline four\r\nwindows\ttab\t\ttabs",
    "   leading and trailing spaces   ",
    "\n\n\n",
    " \t \n ",
    "digits 1 12 123 1234 12345 3.14159 1,000,000 2024-01-15",
    "日本語のテキスト、中文文本。한국어 텍스트",
    "Café naïve résumé Ångström Straße",
    "e\u0301 a\u0300 combining: cafe\u0301, A\u030a, n\u0303",  # decomposed forms (NFC composes them)
    "Emoji 🎉🚀👍🏽 family 👨‍👩‍👧 heart ❤️ flag 🇯🇵",
    "Русский текст ελληνικά עברית العربية हिन्दी ไทย",
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "{\"key\": [1, 2, 3], \"nested\": {\"a\": null}}",
    "<html><body>Hello, World!</body></html>",
    "Mixed: abc123def 456ghi 7j8k9",
    "punctuation!!! ??? ... --- ___ ***",
    "zero\u200bwidth and non\u00a0breaking and ideographic\u3000space",
    "unknown scripts: ᚠᛇᚻ ꦧꦱꦗ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𓀀",
    "  two leading",
    "a<sep>b <sep> c  <sep>  d<sep><|user|>\n<|user|> x",  # user-defined pieces mid-text
    "<start_of_turn>user\n  Hi<end_of_turn>\n<start_of_turn>model\n x <end_of_turn> <mask>",  # Gemma's turns
    "İstanbul İ ı ǅ ẞ ﬁ",  # special casing
    "ΟΔΥΣΣΕΥΣ ὈΔΥΣΣΕΎΣ Σ. ΆΣ! İİ İ\u0307 ǅǈǋǲ ẞSS Ꞵ ᾈᾼ ǰ ŉ",  # final sigma, titlecase digraphs, İ twice
    "mixed scripts: abcабвαβγ日本ab12",
    # decompositions newer than the tokenizers' normalizers know ([Normalization's Unicode] in unicode.cpp)
    "\u32ff \ua7f2\ua7f4 \uab69 \U00010781\U000107ba \U0001e030\u0301 \U0001f16c \U0001fbf0\U0001fbf9 "
    "\U00011935\U00011930 \U00011938 ﬁ\u32ff\u0301 e\u0301\U0001fbf1e\u0301",
]


def cased_texts():
    """Every code point that the tokenizers' Lowercase or Python's str.lower changes, 48 to a text: lower-casing
    held to the tokenizers' own code point by code point ([Full lowercase] in client_runtime/text/unicode.cpp)."""
    from tokenizers import normalizers

    lowercase = normalizers.Lowercase()
    cased = [chr(c) for c in range(0x110000) if not 0xD800 <= c < 0xE000
             and (lowercase.normalize_str(chr(c)) != chr(c) or chr(c).lower() != chr(c))]
    return [" ".join(cased[i:i + 48]) for i in range(0, len(cased), 48)]


def random_texts(specials, count, seed):
    """Texts drawn at random from the kinds of characters where tokenizers differ: runs of spaces, tabs and line
    breaks, contractions in either case, digits, punctuation, accents and combining marks, CJK, emoji with joiners
    and modifiers, other scripts, and the family's special tokens."""
    rng = random.Random(seed)
    pools = [
        list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"), list("0123456789"), list(" "), list("  \t\n\r"),
        list(".,;:!?-_()[]{}<>/\\|@#$%^&*+=~`\"'"), ["'s", "'S", "'t", "'re", "'VE", "'m", "'ll", "'d", "'x"],
        list("éèêëàâäôöûüçñÅåØøßÆæœ"), ["\u0301", "\u0300", "\u0308", "\u0327", "\u20dd"], list("日本語中文字한국어テキスト"),
        ["🎉", "🚀", "👍🏽", "👨\u200d👩\u200d👧", "❤️", "🇯🇵", "\u200b", "\u00a0", "\u3000"], list("русскийελληνικάעבריתالعربية"),
        list("①²½Ⅻ٣७"), specials,
    ]
    texts = []
    for _ in range(count):
        pieces = []
        for _ in range(rng.randrange(1, 25)):
            pool = rng.choice(pools)
            pieces.append("".join(rng.choice(pool) for _ in range(rng.randrange(1, 4))))
        texts.append("".join(pieces))
    return texts


def special_cases(specials):
    """Texts with the family's special tokens embedded, as chat templates and FIM prompts put them."""
    a = specials[0]
    b = specials[-1]
    return [
        f"{a}Hello world{b}",
        f"before {a} middle {b} after",
        f"{a}{b}{a}",
        f"text{a}\n{b}\n\nmore text {a}",
        f"  {a}  spaced  {b}  ",
        f" {b} ",
        f"x{b}y",
        f"{b}  two leading",
    ]


def byte_level_family(name, tokenizers):
    """A tokenizers.Tokenizer configured as `name`'s real tokenizer.json, untrained; its special tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    if name == "gpt2":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
        tok.post_processor = processors.ByteLevel(trim_offsets=True)
        specials = ["<|endoftext|>"]
    elif name == "llama3":
        tok = Tokenizer(models.BPE(ignore_merges=True))
        pattern = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                   r"|\s*[\r\n]+|\s+(?!\S)|\s+")
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ])
        specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|eot_id|>"]
    elif name == "qwen2":
        tok = Tokenizer(models.BPE())
        tok.normalizer = normalizers.NFC()
        pattern = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                   r"|\s*[\r\n]+|\s+(?!\S)|\s+")
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ])
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    elif name == "lowercase":
        tok = Tokenizer(models.BPE())
        tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
        specials = ["<|endoftext|>"]
    elif name == "starcoder":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ])
        tok.post_processor = processors.ByteLevel(trim_offsets=True)
        specials = ["<|endoftext|>", "<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>"]
    else:
        raise ValueError(name)
    tok.decoder = decoders.ByteLevel()
    return tok, specials


def train_byte_level(name, out_dir):
    import tokenizers
    from tokenizers import AddedToken, pre_tokenizers, processors, trainers

    tok, specials = byte_level_family(name, tokenizers)
    trainer = trainers.BpeTrainer(vocab_size=900, min_frequency=1, special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TRAINING * 3, trainer)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    if name == "llama3":
        bos = specials[0]
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True),
            processors.TemplateProcessing(single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                                          special_tokens=[(bos, tok.token_to_id(bos))]),
        ])
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    config = {"gpt2": {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"},
              "llama3": {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"},
              "qwen2": {"bos_token": None, "eos_token": "<|endoftext|>"},
              "starcoder": {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"},
              "lowercase": {"bos_token": None, "eos_token": "<|endoftext|>"}}[name]
    config.update({"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False})
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return auto_tokenizer(out_dir, specials)


def auto_tokenizer(out_dir, specials):
    """What transformers' AutoTokenizer makes of the checkpoint's tokenizer files: the reference."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(out_dir)

    def encode(text, add_special_tokens):
        return tok(text, add_special_tokens=add_special_tokens)["input_ids"]

    def decode(ids, skip):
        return tok.decode(ids, skip_special_tokens=skip)

    return encode, decode, specials, tok.bos_token_id, tok.eos_token_id, len(tok)


def save_sentencepiece(out_dir, work_dir, config, **options):
    """A SentencePiece model alone (no tokenizer.json) trained on the built-in corpus with SentencePieceTrainer's
    `options` (small: character coverage 1, identity normalization, no extra whitespace removal, as Llama 2's and
    Gemma's tokenizer.model have), saved in out_dir as tokenizer.model with tokenizer_config.json `config`."""
    import sentencepiece as spm

    os.makedirs(out_dir, exist_ok=True)
    corpus = os.path.join(work_dir, "spm_corpus.txt")
    with open(corpus, "w") as f:
        f.write("\n".join(TRAINING * 3))
    prefix = os.path.join(out_dir, "tokenizer")
    spm.SentencePieceTrainer.train(input=corpus, model_prefix=prefix, character_coverage=1.0,
                                   normalization_rule_name="identity", remove_extra_whitespaces=False, minloglevel=2,
                                   **options)
    os.rename(prefix + ".model", os.path.join(out_dir, "tokenizer.model"))
    os.remove(prefix + ".vocab")
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1)


def train_sentencepiece(model_type, out_dir, work_dir, config=None, user_defined=()):
    """A SentencePiece model alone, with tokenizer_config.json's LlamaTokenizer updated by `config` (legacy,
    add_prefix_space); the reference is what AutoTokenizer converts it to ([SentencePiece conversion] in
    client_runtime/text/sentencepiece_model.h)."""
    # Llama 2's trainer settings, small: byte fallback, digits split, whitespace-only pieces.
    options = dict(vocab_size=600 if model_type == "bpe" else 200, model_type=model_type, split_digits=True,
                   allow_whitespace_only_pieces=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1)
    if model_type == "bpe":
        options["byte_fallback"] = True
    if user_defined:
        options["user_defined_symbols"] = list(user_defined)
    save_sentencepiece(out_dir, work_dir, {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True,
                                           "add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>",
                                           "unk_token": "<unk>", **(config or {})}, **options)
    return auto_tokenizer(out_dir, ["<s>", "</s>"])


def train_gemma(out_dir, work_dir, config, with_pad_and_mask):
    """A SentencePiece model alone trained with the options of Gemma's tokenizer.model (small), with
    tokenizer_config.json `config`; the reference is what AutoTokenizer converts it to as GemmaTokenizer
    ([SentencePiece conversion] in client_runtime/text/sentencepiece_model.h)."""
    user_defined = ["<mask>"] if with_pad_and_mask else []
    save_sentencepiece(out_dir, work_dir, config, vocab_size=600, model_type="bpe", split_digits=True,
                       allow_whitespace_only_pieces=True, byte_fallback=True, add_dummy_prefix=False,
                       pad_id=0 if with_pad_and_mask else -1, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>",
                       eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>",
                       user_defined_symbols=user_defined + ["<start_of_turn>", "<end_of_turn>"])
    return auto_tokenizer(out_dir, GEMMA_SPECIALS)


# Gemma's special tokens that every Gemma family has (the turn markers, user-defined pieces, are not special).
GEMMA_SPECIALS = ["<bos>", "<unk>", "<eos>"]


def converted_gemma(spm_dir, out_dir, rewritten):
    """The tokenizer.json and tokenizer_config.json transformers writes for gemma_spm; with `rewritten`, the file in
    Llama 2's form instead (Metaspace pre-tokenizer splitting at every space, no normalizer, no byte fallback, the
    Metaspace decoder) and a post-processor adding EOS, not BOS. AutoTokenizer rebuilds the pipeline as
    GemmaTokenizer's either way, keeping the post-processor: that is the reference."""
    import transformers

    transformers.AutoTokenizer.from_pretrained(spm_dir).save_pretrained(out_dir)
    if rewritten:
        path = os.path.join(out_dir, "tokenizer.json")
        with open(path) as f:
            file = json.load(f)
        file["normalizer"] = None
        metaspace = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always", "split": True}
        file["pre_tokenizer"] = metaspace
        file["decoder"] = metaspace
        file["model"]["byte_fallback"] = False
        eos = file["model"]["vocab"]["<eos>"]
        file["post_processor"] = {"type": "TemplateProcessing",
                                  "single": [{"Sequence": {"id": "A", "type_id": 0}},
                                             {"SpecialToken": {"id": "<eos>", "type_id": 0}}],
                                  "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                                           {"Sequence": {"id": "B", "type_id": 1}}],
                                  "special_tokens": {"<eos>": {"id": "<eos>", "ids": [eos], "tokens": ["<eos>"]}}}
        with open(path, "w") as f:
            json.dump(file, f, ensure_ascii=False)
    return auto_tokenizer(out_dir, GEMMA_SPECIALS)


def converted_llama2(spm_dir, out_dir, legacy):
    """The tokenizer.json transformers writes for the SentencePiece BPE model (Metaspace with prepend_scheme
    "first", BPE with byte fallback, the Replace/ByteFallback/Fuse/Strip decoders), its tokenizer_config.json's
    legacy false; with `legacy`, the normalizer of the Llama 2 checkpoints on the Hub instead (Prepend("▁") and
    Replace(" ", "▁"), no pre-tokenizer) and legacy true. What AutoTokenizer makes of them is the reference."""
    import transformers

    converted = transformers.AutoTokenizer.from_pretrained(spm_dir)
    converted.save_pretrained(out_dir)
    path = os.path.join(out_dir, "tokenizer.json")
    if legacy:
        with open(path) as f:
            file = json.load(f)
        file["normalizer"] = {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "\u2581"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]}
        file["pre_tokenizer"] = None
        with open(path, "w") as f:
            json.dump(file, f, ensure_ascii=False)
    config_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["legacy"] = legacy
    with open(config_path, "w") as f:
        json.dump(config, f, indent=1)
    return auto_tokenizer(out_dir, ["<s>", "</s>"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    try:
        import google.protobuf  # noqa: F401  (transformers reads tokenizer.model with it)
        import sentencepiece  # noqa: F401
        import tokenizers  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        return missing(e)

    expected = {}
    cased = cased_texts()
    for family in ("gpt2", "llama3", "qwen2", "starcoder", "lowercase", "spm_bpe", "spm_bpe_legacy", "spm_bpe_no_prefix",
                   "spm_unigram", "llama2_json", "llama2_legacy_json", "gemma_spm", "gemma_spm_eos", "gemma_json",
                   "gemma_rewritten_json"):
        out_dir = os.path.join(args.output, family)
        if family == "gemma_spm":
            made = train_gemma(out_dir, args.output, {"tokenizer_class": "GemmaTokenizer", "add_bos_token": True,
                                                      "add_eos_token": False, "legacy": True}, True)
        elif family == "gemma_spm_eos":
            made = train_gemma(out_dir, args.output, {"tokenizer_class": "GemmaTokenizerFast", "add_eos_token": True},
                               False)
        elif family.startswith("gemma_"):
            made = converted_gemma(os.path.join(args.output, "gemma_spm"), out_dir, "rewritten" in family)
        elif family.startswith("llama2_"):
            made = converted_llama2(os.path.join(args.output, "spm_bpe"), out_dir, "legacy" in family)
        elif family == "spm_bpe_legacy":
            made = train_sentencepiece("bpe", out_dir, args.output, {"legacy": True}, ["<sep>", "<|user|>"])
        elif family == "spm_bpe_no_prefix":
            made = train_sentencepiece("bpe", out_dir, args.output, {"add_prefix_space": False})
        elif family.startswith("spm_"):
            made = train_sentencepiece(family[4:], out_dir, args.output)
        else:
            made = train_byte_level(family, out_dir)
        encode, decode, specials, bos, eos, vocab_size = made
        cases = []
        for text in CORPUS + cased + special_cases(specials) + random_texts(specials, 150, len(family)):
            ids = encode(text, True)
            cases.append({"text": text, "ids": ids, "ids_plain": encode(text, False),
                          "decoded": decode(ids, False), "decoded_skip": decode(ids, True)})
        rng = random.Random(len(family))
        decode_cases = []
        for _ in range(40):
            ids = [rng.randrange(vocab_size) for _ in range(rng.randrange(1, 12))]
            decode_cases.append({"ids": ids, "decoded": decode(ids, False), "decoded_skip": decode(ids, True)})
        expected[family] = {"dir": out_dir, "cases": cases, "decode_cases": decode_cases, "bos": bos, "eos": eos,
                            "vocab_size": vocab_size, "specials": specials}
    with open(os.path.join(args.output, "expected.json"), "w") as f:
        json.dump(expected, f, ensure_ascii=False, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
