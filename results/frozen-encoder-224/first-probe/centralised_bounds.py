"""Centralised bounds on the Lite0 224 px bilinear cache (scikit-learn, all 50,000 training images)."""
import time, json
import numpy as np, torch
torch.set_num_threads(2)
from flare.data.features import FeatureOptions, load_features
from sklearn.discriminant_analysis import LinearDiscriminantAnalysis
from sklearn.linear_model import RidgeClassifier
out = {}
for stages in (1, 4):
    opts = FeatureOptions(source="cifar10", root="/work/shared/data/cifar10-jpg.tar.gz", format="imagefolder",
                          encoder="efficientnet_lite0", resize="bilinear", stages=stages, views=0, batch_size=128,
                          cache_dir="/work/cache/features")
    d = load_features(opts, quiet=True)
    X, y = d.train_x[:, 0].double().numpy(), d.train_y.numpy()
    Xt, yt = d.test_x[:, 0].double().numpy(), d.test_y.numpy()
    for name, clf in (("lda_auto", LinearDiscriminantAnalysis(solver="lsqr", shrinkage="auto")),
                      ("lda_0.05", LinearDiscriminantAnalysis(solver="lsqr", shrinkage=0.05)),
                      ("ridge", RidgeClassifier(alpha=1.0))):
        t0 = time.time(); clf.fit(X, y); acc = float(clf.score(Xt, yt))
        out[f"stages{stages}/{name}"] = acc
        print(f"stages={stages} d={X.shape[1]} {name}: {100*acc:.2f} % ({time.time()-t0:.0f} s)", flush=True)
json.dump(out, open("/tmp/bounds.json", "w"), indent=1)
